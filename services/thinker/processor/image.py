"""Image slicing for the thinker (docs/model.md, Thinker inputs): overview + up to ``max_slice_nums``
high-res cells.

The grid rules fix the number of vision tokens, so they are part of the prompt contract:

1. ``multiple = min(ceil(W * H / scale**2), max_slice_nums)``; at most 1 -> no slicing, the image is
   resized (upscaling allowed) to about ``scale**2`` pixels with sides rounded to multiples of the patch;
2. otherwise the grid (cols, rows) with ``cols * rows`` in ``{multiple - 1, multiple, multiple + 1}``
   (neither 1 nor above the maximum) closest to the aspect ratio in log space wins (first wins ties);
   the overview is the downscaled image, and the image is resized so each cell is about ``scale**2``;
3. every slice is normalised with mean = std = 0.5 and laid out patch by patch (``[3, p, p * n]``).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from services.thinker.errors import media_error

# Decoding guard: refuse absurd images before PIL allocates them (about 8k x 8k).
MAX_IMAGE_PIXELS = 64_000_000


@dataclass(frozen=True)
class SliceConfig:
    max_slice_nums: int = 9
    scale_resolution: int = 448
    patch_size: int = 14
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


@dataclass
class SlicedImage:
    """One image after slicing: the overview first, then the cells row by row."""

    slices: list[torch.Tensor]  # each [3, patch, patch * h * w], float32
    tgt_sizes: list[tuple[int, int]]  # (h, w) in patches, per slice
    grid: tuple[int, int] | None  # (cols, rows) or None when not sliced


def decode_image(data: object, param: str) -> Image.Image:
    """Bytes / PIL image / ``[H, W, 3]`` uint8 array -> RGB PIL image, or a typed media error."""
    if isinstance(data, Image.Image):
        img = data
    elif isinstance(data, np.ndarray):
        arr = data
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, axis=-1)
        if arr.ndim != 3 or arr.shape[-1] not in (3, 4) or arr.size == 0:
            raise media_error(param, f"image array must be [H, W, 3] (got shape {list(arr.shape)})")
        if arr.dtype != np.uint8:
            if np.issubdtype(arr.dtype, np.floating):
                arr = np.clip(arr * 255.0, 0, 255)
            arr = arr.astype(np.uint8)
        img = Image.fromarray(arr)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if not raw:
            raise media_error(param, "image data is empty")
        try:
            img = Image.open(io.BytesIO(raw))
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise media_error(param, f"image of {img.width}x{img.height} pixels is too large")
            img.load()
        except (
            UnidentifiedImageError,
            OSError,
            SyntaxError,
            ValueError,
            Image.DecompressionBombError,
        ) as exc:
            raise media_error(param, f"cannot decode image ({exc.__class__.__name__}: {exc})") from exc
    else:
        raise media_error(param, f"unsupported image input type {type(data).__name__}")
    if img.width < 1 or img.height < 1:
        raise media_error(param, "image has zero size")
    return img.convert("RGB")


def _round_to_multiple(length: float, multiple: int) -> int:
    return max(round(length / multiple) * multiple, multiple)


def best_resize(size: tuple[float, float], scale: int, patch: int, allow_upscale: bool) -> tuple[int, int]:
    """Area-preserving resize to about ``scale**2`` pixels (only shrinks unless ``allow_upscale``)."""
    width, height = size
    if width * height > scale * scale or allow_upscale:
        ratio = width / height
        height = int(scale / math.sqrt(ratio))
        width = int(height * ratio)
    return _round_to_multiple(width, patch), _round_to_multiple(height, patch)


def refine_size(size: tuple[int, int], grid: tuple[int, int], scale: int, patch: int) -> tuple[int, int]:
    """Size of the image to cut into ``grid`` cells, each cell about ``scale**2`` pixels."""
    width, height = size
    cols, rows = grid
    cell_w = _round_to_multiple(width, cols) / cols
    cell_h = _round_to_multiple(height, rows) / rows
    best_w, best_h = best_resize((cell_w, cell_h), scale, patch, allow_upscale=True)
    return best_w * cols, best_h * rows


def choose_grid(size: tuple[int, int], max_slice_nums: int, scale: int) -> tuple[int, int] | None:
    """(cols, rows) for an image of ``size`` = (W, H), or None when it is not sliced."""
    width, height = size
    multiple = min(math.ceil(width * height / (scale * scale)), max_slice_nums)
    if multiple <= 1:
        return None
    log_ratio = math.log(width / height)
    best: tuple[int, int] = (1, 1)
    best_err = float("inf")
    for count in (multiple - 1, multiple, multiple + 1):
        if count == 1 or count > max_slice_nums:
            continue
        for cols in range(1, count + 1):
            if count % cols:
                continue
            err = abs(log_ratio - math.log(cols / (count // cols)))
            if err < best_err:
                best, best_err = (cols, count // cols), err
    return best


def num_slices(size: tuple[int, int], max_slice_nums: int, scale: int) -> int:
    grid = choose_grid(size, max_slice_nums, scale)
    return 1 if grid is None else 1 + grid[0] * grid[1]


def to_patch_layout(img: Image.Image, cfg: SliceConfig) -> tuple[torch.Tensor, tuple[int, int]]:
    """RGB image (sides multiples of the patch) -> normalised ``[3, p, p * h * w]`` + (h, w) in patches."""
    p = cfg.patch_size
    arr = np.asarray(img, dtype=np.uint8).astype(np.float32) / 255
    arr = (arr - np.asarray(cfg.mean, dtype=np.float32)) / np.asarray(cfg.std, dtype=np.float32)
    chw = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
    h, w = chw.shape[1] // p, chw.shape[2] // p
    # [3, h, p, w, p] -> [3, p(row in patch), h, w, p(col in patch)] -> patches side by side.
    patches = chw[:, : h * p, : w * p].reshape(3, h, p, w, p).permute(0, 2, 1, 3, 4).reshape(3, p, h * w * p)
    return patches.contiguous(), (h, w)


def slice_image(img: Image.Image, cfg: SliceConfig, max_slice_nums: int | None = None) -> SlicedImage:
    """Overview + cells of one image, each normalised and in patch layout."""
    max_slices = cfg.max_slice_nums if max_slice_nums is None else int(max_slice_nums)
    if max_slices < 1:
        raise ValueError("max_slice_nums must be >= 1")
    scale, patch = cfg.scale_resolution, cfg.patch_size
    grid = choose_grid(img.size, max_slices, scale)
    pieces: list[Image.Image] = []
    if grid is None:
        pieces.append(
            img.resize(best_resize(img.size, scale, patch, True), resample=Image.Resampling.BICUBIC)
        )
    else:
        pieces.append(
            img.resize(best_resize(img.size, scale, patch, False), resample=Image.Resampling.BICUBIC)
        )
        refined = img.resize(refine_size(img.size, grid, scale, patch), resample=Image.Resampling.BICUBIC)
        cell_w, cell_h = refined.width // grid[0], refined.height // grid[1]
        for top in range(0, refined.height, cell_h):
            for left in range(0, refined.width, cell_w):
                pieces.append(refined.crop((left, top, left + cell_w, top + cell_h)))
    slices, sizes = [], []
    for piece in pieces:
        tensor, hw = to_patch_layout(piece, cfg)
        slices.append(tensor)
        sizes.append(hw)
    return SlicedImage(slices=slices, tgt_sizes=sizes, grid=grid)


def image_placeholder(
    grid: tuple[int, int] | None, query_num: int, image_id: int | None, unk: str = "<unk>"
) -> str:
    """Prompt text of one image: ``[<image_id>k</image_id>]<image>{unk*Q}</image>`` then the cell rows.

    Cells of one row are concatenated, rows are joined with a newline.
    """
    text = "" if image_id is None else f"<image_id>{image_id}</image_id>"
    text += "<image>" + unk * query_num + "</image>"
    if grid is not None:
        cell = "<slice>" + unk * query_num + "</slice>"
        text += "\n".join(cell * grid[0] for _ in range(grid[1]))
    return text
