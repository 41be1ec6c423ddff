"""Accuracy of integer predictions, as an `evaluate` module that ships with performer_hf (loads offline with
`evaluate.load(path)`, unlike `evaluate.load("accuracy")`, which needs the Hub)."""

import datasets
import evaluate

_DESCRIPTION = "Fraction of predictions equal to their references (here: masked tokens predicted correctly)."
_INPUTS = """
Args:
    predictions (`list[int]`): predicted token ids.
    references (`list[int]`): true token ids.
Returns:
    accuracy (`float`): in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        if not references:
            return {"accuracy": float("nan")}
        correct = sum(int(p == r) for p, r in zip(predictions, references, strict=True))
        return {"accuracy": correct / len(references)}
