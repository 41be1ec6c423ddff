"""Random projection matrices for random-feature attention.

Every function here is pure tensor code: no Hugging Face imports, no CPU round trips, so a projection can be redrawn on
the accelerator during training without synchronising.
"""

from __future__ import annotations

import math

import torch

PROJECTION_KINDS = ("orthogonal", "gaussian", "structured")
NORM_KINDS = ("chi", "fixed")


def _row_norms(num_rows: int, head_dim: int, norms: str, generator, device, dtype) -> torch.Tensor:
    """Norms to give each projection row: chi-distributed (the norm of a Gaussian vector) or the fixed sqrt(d)."""
    if norms == "chi":
        return torch.randn(num_rows, head_dim, generator=generator, device=device, dtype=dtype).norm(dim=1)
    return torch.full((num_rows,), math.sqrt(head_dim), device=device, dtype=dtype)


def _orthogonal_blocks(num_blocks: int, head_dim: int, generator, device, dtype) -> torch.Tensor:
    """`num_blocks` Haar-random orthogonal (d, d) matrices, stacked to (num_blocks * d, d)."""
    gaussian = torch.randn(num_blocks, head_dim, head_dim, generator=generator, device=device, dtype=dtype)
    q, r = torch.linalg.qr(gaussian)  # batched QR, (n, d, d)
    # Householder QR is not Haar-uniform on its own: fix the signs with the diagonal of R.
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.transpose(-1, -2).reshape(num_blocks * head_dim, head_dim)  # rows of each block are orthonormal


def hadamard_matrix(size: int, *, device=None, dtype=None) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix of a power-of-two `size` (orthogonal, entries +-1/sqrt(size))."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"hadamard_matrix needs a power of two, got {size}")
    h = torch.ones(1, 1, device=device, dtype=dtype)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / math.sqrt(size)


def _structured_blocks(num_blocks: int, head_dim: int, generator, device, dtype) -> torch.Tensor:
    """Blocks H D3 H D2 H D1 (H normalised Hadamard, D random sign diagonals), materialised.

    For a head dim d that is not a power of two, the transform acts on inputs zero-padded to p = next power of two; its
    first d columns form a (p, d) tight frame (columns orthonormal), so each block gives p rows instead of d.
    """
    p = 1 << (head_dim - 1).bit_length()
    h = hadamard_matrix(p, device=device, dtype=dtype)
    signs = torch.randint(0, 2, (num_blocks, 3, p), generator=generator, device=device).to(dtype) * 2 - 1
    block = h * signs[:, 0, None, :]  # H D1, (n, p, p)
    for i in (1, 2):
        block = h @ (signs[:, i, :, None] * block)  # M <- H D_i M
    return block[..., :head_dim].reshape(num_blocks * p, head_dim)


def draw_projection(
    num_features: int,
    head_dim: int,
    *,
    kind: str = "orthogonal",
    norms: str = "chi",
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Draw a random projection for random-feature attention.

    Args:
        num_features (`int`):
            Number of random features `m` (rows).
        head_dim (`int`):
            Size `d` of each query/key vector (columns).
        kind (`str`, *optional*, defaults to `"orthogonal"`):
            `"gaussian"`: i.i.d. N(0, 1) entries. `"orthogonal"`: stacked blocks of d rows that are exactly orthogonal
            (QR of Gaussian blocks), the paper's lower-variance choice. `"structured"`: blocks H D3 H D2 H D1 of
            normalised Hadamard matrices and random sign diagonals (materialised, so applying it is one matmul); for
            a head dim that is not a power of two, each block is a tight frame of the padded transform.
        norms (`str`, *optional*, defaults to `"chi"`):
            Row norms for the orthogonal and structured kinds (and, if `"fixed"`, for Gaussian too): `"chi"` gives each
            row the norm of an independent Gaussian vector, so every row is marginally N(0, I_d) and the softmax
            estimators stay unbiased; `"fixed"` gives every row the norm sqrt(d).
        generator (`torch.Generator`, *optional*):
            Source of randomness, on the same device as `device`.
        device, dtype: where and in what precision to build the matrix (defaults: torch defaults).

    Returns:
        `torch.Tensor` of shape `(num_features, head_dim)`.

    Example:
        >>> w = draw_projection(256, 64, generator=torch.Generator().manual_seed(0))
        >>> w.shape
        torch.Size([256, 64])
    """
    if kind not in PROJECTION_KINDS:
        raise ValueError(f"kind must be one of {PROJECTION_KINDS}, got {kind!r}")
    if norms not in NORM_KINDS:
        raise ValueError(f"norms must be one of {NORM_KINDS}, got {norms!r}")
    if num_features < 1 or head_dim < 1:
        raise ValueError(f"num_features and head_dim must be positive, got {num_features} and {head_dim}")
    dtype = dtype or torch.get_default_dtype()
    build_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # QR in at least fp32

    if kind == "gaussian":
        w = torch.randn(num_features, head_dim, generator=generator, device=device, dtype=build_dtype)
        if norms == "fixed":
            w = w / w.norm(dim=1, keepdim=True) * math.sqrt(head_dim)
        return w.to(dtype)

    if kind == "orthogonal":
        rows_per_block = head_dim
        blocks = _orthogonal_blocks(math.ceil(num_features / rows_per_block), head_dim, generator, device, build_dtype)
    else:
        rows_per_block = 1 << (head_dim - 1).bit_length()
        blocks = _structured_blocks(math.ceil(num_features / rows_per_block), head_dim, generator, device, build_dtype)
    directions = blocks[:num_features]
    directions = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
    w = directions * _row_norms(num_features, head_dim, norms, generator, device, build_dtype).unsqueeze(1)
    return w.to(dtype)
