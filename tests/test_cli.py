"""The command line end to end on tiny local models; uploads go to a loopback fake Hub."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub
from tiny_models import inputs, save_tiny, tiny_model

import performer_hf
from performer_hf.cli import main

CONSOLE = Path(sys.executable).parent / "performer-hf"


@pytest.fixture
def fake_hub(monkeypatch):
    from huggingface_hub import constants

    with FakeHub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", hub.token)
        yield hub


@pytest.fixture
def bert_dir(tmp_path):
    return save_tiny(tmp_path / "tiny-bert", "bert")


def no_leftovers(parent: Path):
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_convert_writes_a_directory_that_loads_to_the_same_model(bert_dir, tmp_path, capsys):
    out = tmp_path / "bert-performer"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "16", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "converted 2 attention layers" in printed and "top-1 prediction agreement" in printed
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "fidelity.json"} <= {
        p.name for p in out.iterdir()}
    loaded = performer_hf.from_pretrained(str(out)).eval()
    expected = performer_hf.convert(tiny_model("bert"), num_features=16, seed=3)
    ids, mask = inputs(pad_last=2)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits,
                           expected(input_ids=ids, attention_mask=mask).logits)
    assert loaded.config.performer["base_model"] == bert_dir
    assert no_leftovers(tmp_path)


def test_learned_hedgehog_flags_reach_the_saved_model(bert_dir, tmp_path):
    out = tmp_path / "hedgehog"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8", "--kernel", "hedgehog",
                 "--learned-features", "--per-head-features", "--feature-bias"]) == 0
    loaded = performer_hf.from_pretrained(str(out))
    settings = performer_hf.performer_settings(loaded.config)
    assert (settings.kernel, settings.learned_features, settings.per_head_features, settings.feature_bias) == (
        "hedgehog", True, True, True)
    favor = next(iter(performer_hf.converted_modules(loaded).values()))
    assert favor.feature_bias.shape == (2, 4, 8)  # queries and keys, per head (tiny BERT: 4 heads), m = 8


def test_model_card_has_hub_metadata_and_the_fidelity(bert_dir, tmp_path):
    out = tmp_path / "card"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8", "--kernel", "favor++"]) == 0
    card = (out / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    for line in ("library_name: performer-hf", "pipeline_tag: fill-mask", "- performer", "- favor",
                 "- linear-attention"):
        assert line in front
    assert "| kernel | favor++ |" in body and "top-1 prediction agreement" in body
    assert "performer_hf.from_pretrained" in body and "performer-hf finetune" in body and "needs a short" in body


def test_causal_model_and_base_task(tmp_path, capsys):
    src = save_tiny(tmp_path / "tiny-gpt2", "gpt2")
    assert main(["convert", src, "--out", str(tmp_path / "a"), "--num-features", "16"]) == 0
    assert "(gpt2, causal-lm)" in capsys.readouterr().out
    assert main(["convert", src, "--out", str(tmp_path / "b"), "--task", "base", "--num-features", "16"]) == 0
    assert "hidden-state cosine" in capsys.readouterr().out
    assert type(performer_hf.from_pretrained(str(tmp_path / "b"))).__name__ == "GPT2Model"


def test_causal_report_shows_what_the_sinks_and_window_are_worth(tmp_path, capsys):
    src = save_tiny(tmp_path / "tiny-llama", "llama", initializer_range=0.3)
    out = tmp_path / "local"
    assert main(["convert", src, "--out", str(out), "--num-features", "8", "--sink-tokens", "2",
                 "--local-window", "8"]) == 0
    assert "| converted | pure FAVOR, for comparison |" in capsys.readouterr().out
    report = json.loads((out / "fidelity.json").read_text())
    assert report["tokens"] > 2 * 8  # long windows of joined sentences, well past the exact window
    assert report["kl"] < report["pure_favor"]["kl"]
    settings = performer_hf.performer_settings(performer_hf.from_pretrained(str(out)).config)
    assert (settings.sink_tokens, settings.local_window) == (2, 8)


def test_existing_output_is_refused_without_overwrite(bert_dir, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", bert_dir, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty; pass --overwrite" in err and err.count("\n") == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["convert", bert_dir, "--out", str(out), "--overwrite", "--num-features", "8"]) == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert no_leftovers(tmp_path)


def test_missing_directory_and_unknown_hub_id(tmp_path, capsys, fake_hub):
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "nope"), "--out", str(out)]) == 1
    assert "nope: no such directory" in capsys.readouterr().err
    assert main(["convert", "nobody/no-such-model", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "nobody/no-such-model" in err and "local directory" in err and "Traceback" not in err
    assert not out.exists() and no_leftovers(tmp_path)


def test_offline_hub_id_says_so(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([str(CONSOLE), "convert", "someone/some-model", "--out", str(tmp_path / "o")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "offline mode (HF_HUB_OFFLINE=1)" in result.stderr and "local directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, capsys):
    import transformers

    src = tmp_path / "neo"
    cfg = transformers.GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                    attention_types=[[["global", "local"], 1]])
    transformers.GPTNeoForCausalLM(cfg).save_pretrained(src)
    assert main(["convert", str(src), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "'gpt_neo' cannot be converted" in err and "Supported: albert, bert" in err
    assert not (tmp_path / "o").exists()


def test_bad_flags_are_usage_errors(bert_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", bert_dir, "--out", str(tmp_path / "o"), "--kernel", "softmax"])
    assert exit_info.value.code == 2
    assert main(["convert", bert_dir, "--out", str(tmp_path / "o"), "--num-features", "0"]) == 2
    assert "num_features must be a positive integer" in capsys.readouterr().err
    assert main(["convert", bert_dir, "--out", str(tmp_path / "o"), "--max-length", "0"]) == 2
    assert "--max-length must be positive" in capsys.readouterr().err


def test_max_length_extends_the_position_table(bert_dir, tmp_path, capsys):
    out = tmp_path / "long"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8", "--max-length", "512"]) == 0
    assert "position table extended from 128 to 512 tokens" in capsys.readouterr().out
    model = performer_hf.from_pretrained(str(out)).eval()
    assert model.config.max_position_embeddings == 512
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).model_max_length == 512
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(5, 60, (1, 500))).logits).all()


def test_push_uploads_the_files_and_card(bert_dir, tmp_path, fake_hub, capsys):
    out = tmp_path / "p"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8"]) == 0
    assert main(["push", str(out), "me/bert-performer", "--private", "--commit-message", "first"]) == 0
    repo = fake_hub.repos["me/bert-performer"]
    assert repo["private"] and repo["commits"] == ["first"]
    assert set(repo["files"]) == {p.name for p in out.iterdir()}
    assert repo["files"]["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert b"library_name: performer-hf" in repo["files"]["README.md"]
    assert not fake_hub.unexpected
    assert fake_hub.token not in capsys.readouterr().out


def test_convert_can_push_in_the_same_call(bert_dir, tmp_path, fake_hub):
    out = tmp_path / "cp"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8", "--push-to-hub", "me/x"]) == 0
    assert "config.json" in fake_hub.repos["me/x"]["files"]


def _listing(directory: Path):
    return sorted((p.name, p.stat().st_size) for p in directory.iterdir())


def test_failed_pushes_say_why_and_keep_the_directory(bert_dir, tmp_path, fake_hub, monkeypatch, capsys):
    out = tmp_path / "keep"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8"]) == 0
    before = _listing(out)

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert main(["push", str(out), "me/y"]) == 1
    assert "the token was refused" in capsys.readouterr().err

    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    fake_hub.deny_writes = True
    assert main(["push", str(out), "other/y"]) == 1
    assert "no write access" in capsys.readouterr().err

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    assert main(["push", str(out), "me/y"]) == 1
    assert "no Hugging Face token" in capsys.readouterr().err

    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert main(["push", str(out), "me/y"]) == 1
    assert "unreachable" in capsys.readouterr().err
    assert _listing(out) == before


def test_push_refuses_an_unconverted_directory(tmp_path, capsys):
    src = save_tiny(tmp_path / "plain", "bert")
    assert main(["push", src, "me/plain"]) == 2
    assert "is not a converted model" in capsys.readouterr().err


def test_console_script_help_and_env():
    for argv in (["--help"], ["convert", "--help"], ["push", "--help"], ["env", "--help"]):
        result = subprocess.run([str(CONSOLE), *argv], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "usage: performer-hf" in result.stdout
    assert "--num-features" in subprocess.run([str(CONSOLE), "convert", "--help"], capture_output=True,
                                              text=True, timeout=120).stdout
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(CONSOLE), "env"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0
    for key in ("torch", "transformers", "device", "torch threads", "hub"):
        assert key in result.stdout
    assert "offline mode" in result.stdout


def test_console_script_converts(bert_dir, tmp_path):
    out = tmp_path / "via-console"
    result = subprocess.run([str(CONSOLE), "convert", bert_dir, "--out", str(out), "--num-features", "8"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert performer_hf.is_converted(performer_hf.from_pretrained(str(out)))


def test_push_uploads_only_the_model_and_never_follows_links(bert_dir, tmp_path, fake_hub, capsys):
    out = tmp_path / "dirty"
    assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8"]) == 0
    secret = tmp_path / "secret.txt"
    secret.write_text("HF_TOKEN=hf_do_not_upload")
    (out / "linked.json").symlink_to(secret)  # would be uploaded by name pattern? never: it is a link
    (out / "tokenizer.model").symlink_to(secret)  # an allowed name, but a link out of the directory
    (out / "sub").mkdir()
    (out / "sub" / ".env").write_text("HF_TOKEN=hf_do_not_upload")
    (out / ".env").write_text("HF_TOKEN=hf_do_not_upload")
    for name in ("optimizer.bin", "random_states_0.pkl", "metrics.jsonl", "events.out.tfevents.1"):
        (out / name).write_bytes(b"x")
    (out / "runs" / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    (out / "runs" / "checkpoints" / "checkpoint-1" / "model.safetensors").write_bytes(b"x")
    capsys.readouterr()
    assert main(["push", str(out), "me/clean"]) == 0
    files = fake_hub.repos["me/clean"]["files"]
    assert {"config.json", "model.safetensors", "README.md", "fidelity.json"} <= set(files)
    assert not set(files) & {"linked.json", "tokenizer.model", ".env", "sub/.env", "optimizer.bin",
                             "random_states_0.pkl", "metrics.jsonl", "events.out.tfevents.1",
                             "runs/checkpoints/checkpoint-1/model.safetensors"}
    assert not any(b"hf_do_not_upload" in data for data in files.values())
    printed = capsys.readouterr().out
    assert "uploading" in printed and "left out" in printed and "optimizer.bin" in printed


def _custom_code_model(directory: Path) -> Path:
    """A model folder whose config maps to its own code; importing that code would write `ran.txt`."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "my_custom", "architectures": ["MyModel"],
                                                       "auto_map": {"AutoConfig": "code.MyConfig",
                                                                    "AutoModel": "code.MyModel"}}))
    (directory / "code.py").write_text(f"open({str(directory / 'ran.txt')!r}, 'w').write('ran')\n"
                                       "from transformers import PretrainedConfig\n"
                                       "class MyConfig(PretrainedConfig):\n    model_type = 'my_custom'\n")
    return directory


def test_custom_code_never_runs_even_on_a_terminal(tmp_path):
    import pty

    model = _custom_code_model(tmp_path / "custom")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    pid, fd = pty.fork()
    if pid == 0:  # the child runs the CLI on a terminal, where transformers would ask "[y/N]"
        os.execve(str(CONSOLE), [str(CONSOLE), "convert", str(model), "--out", str(tmp_path / "o")], env)
    output = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
        if b"[y/N]" in output:
            os.write(fd, b"y\n")  # a careless user says yes: still nothing may run
    _, status = os.waitpid(pid, 0)
    text = output.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 1, text
    assert "custom-code models are not supported" in text and "[y/N]" not in text and "offline" not in text
    assert not (model / "ran.txt").exists()


def test_custom_code_is_refused_by_the_python_api(tmp_path):
    model = _custom_code_model(tmp_path / "custom")
    with pytest.raises(ValueError, match="custom-code models are not supported"):
        performer_hf.from_pretrained(str(model), trust_remote_code=True)
    with pytest.raises(ValueError, match="custom-code models are not supported"):
        performer_hf.from_pretrained(str(model))
    assert not (model / "ran.txt").exists()


def test_env_never_prints_credentials_in_the_endpoint(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://alice:s3cret-pass@127.0.0.1:9/hub?token=hf_abc"}
    result = subprocess.run([str(CONSOLE), "env", "--timeout", "1"], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0
    assert "s3cret-pass" not in result.stdout + result.stderr and "alice" not in result.stdout + result.stderr
    assert "hf_abc" not in result.stdout + result.stderr and "***@127.0.0.1:9" in result.stdout


def test_invalid_values_exit_2_with_one_line(bert_dir, tmp_path, capsys):
    for flags in (["--max-length", "0"], ["--max-steps", "0"], ["--learning-rate", "-1"]):
        assert main(["finetune", str(tmp_path / "m"), "--out", str(tmp_path / "o"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err
    existing = tmp_path / "a-file"
    existing.write_text("x")
    assert main(["finetune", bert_dir, "--out", str(existing)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_ctrl_c_while_importing_exits_130_with_one_line(tmp_path):
    import signal
    import time

    process = subprocess.Popen([str(CONSOLE), "env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.4)  # Python is up; torch and transformers are still importing
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("interrupted") and err.count("\n") == 1


def test_convert_cleans_what_a_killed_convert_left_and_writes_normal_permissions(bert_dir, tmp_path):
    out = tmp_path / "perm"
    stale = tmp_path / ".perm.partial-999999999-abc"  # no such process
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    old_umask = os.umask(0o022)
    try:
        assert main(["convert", bert_dir, "--out", str(out), "--num-features", "8"]) == 0
    finally:
        os.umask(old_umask)
    assert not stale.exists()
    assert (out.stat().st_mode & 0o777) == 0o755
