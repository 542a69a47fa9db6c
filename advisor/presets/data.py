"""Synthetic map-style datasets for the presets: one sample per item, deterministic per (seed, index).

Token, tabular and click datasets are cheap on purpose. Image datasets do real CPU work per
sample (decode, crop, flip, normalise, then busy work up to `decode_cost_ms`) so that the
number of DataLoader workers matters the way it does for JPEG pipelines.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch
from torch.utils.data import Dataset

# ImageNet channel statistics (HWC broadcast), used by every torchvision-style pipeline.
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _item_generator(seed: int, index: int) -> torch.Generator:
    # Distinct, reproducible stream per sample whatever the worker or access order.
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class _Synthetic(Dataset):
    """Base: a fixed number of samples, each a pure function of (seed, index)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def _check(self, index: int) -> torch.Generator:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        return _item_generator(self.seed, index)


class TokenDataset(_Synthetic):
    """Causal LM samples: (inputs (T,), targets (T,)) int64, targets = inputs shifted by one."""

    def __init__(self, num_samples: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        super().__init__(num_samples, seed)
        self.seq_len, self.vocab = seq_len, vocab

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._check(index)
        window = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
        return window[:-1], window[1:]


class MaskedLMDataset(_Synthetic):
    """BERT MLM samples: (input_ids (T,), labels (T,)); labels are -100 except at masked positions."""

    def __init__(self, num_samples: int, seq_len: int, vocab: int, mask_id: int, seed: int = 0) -> None:
        super().__init__(num_samples, seed)
        self.seq_len, self.vocab, self.mask_id = seq_len, vocab, mask_id

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._check(index)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return mask_tokens(ids, self.mask_id, g)


def mask_tokens(ids: torch.Tensor, mask_id: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask 15% of positions (BERT's rate): inputs get `mask_id` there, labels keep the original."""
    masked = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, mask_id), ids)
    return inputs, labels


class TabularDataset(_Synthetic):
    """Flat-feature classification samples: (x (features,) float32, y () int64)."""

    def __init__(self, num_samples: int, features: int, classes: int, seed: int = 0) -> None:
        super().__init__(num_samples, seed)
        self.features, self.classes = features, classes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._check(index)
        return torch.randn(self.features, generator=g), torch.randint(0, self.classes, (), generator=g)


class ClickDataset(_Synthetic):
    """DLRM samples: (dense (D,) float32, sparse (tables, pooling) int64, label () float32 in {0, 1})."""

    def __init__(self, num_samples: int, dense: int, tables: int, rows: int, pooling: int, seed: int = 0) -> None:
        super().__init__(num_samples, seed)
        self.dense, self.tables, self.rows, self.pooling = dense, tables, rows, pooling

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = self._check(index)
        dense = torch.rand(self.dense, generator=g)  # Criteo dense features are log-scaled, >= 0
        sparse = torch.randint(0, self.rows, (self.tables, self.pooling), generator=g)
        label = (torch.rand((), generator=g) < 0.25).float()  # ~25% click-through, like Criteo
        return dense, sparse, label


class ImageDataset(_Synthetic):
    """Images with a simulated JPEG pipeline: (image (3, S, S) float32, target).

    Target is a class id () int64, or with `segmentation=True` a mask (S, S) int64.
    Each item decompresses an encoded image (zlib stands in for the JPEG entropy decoder),
    random-crops S x S from a source 8/7 larger (the usual resize-256/crop-224 ratio), flips,
    jitters colour, converts HWC uint8 to normalised CHW float, then burns CPU until
    `decode_cost_ms` has passed: one item costs max(decode_cost_ms, the real work) of one core.
    The pixel work is numpy, single-threaded like PIL, so it never contends with torch's
    intra-op threads; that work alone is about 2 ms at 224 px on one core.
    """

    def __init__(self, num_samples: int, image_size: int, classes: int, decode_cost_ms: float,
                 seed: int = 0, segmentation: bool = False) -> None:
        super().__init__(num_samples, seed)
        self.image_size, self.classes = image_size, classes
        self.decode_cost_ms, self.segmentation = decode_cost_ms, segmentation
        self.source_size = image_size * 8 // 7
        self._encoded: bytes | None = None  # built on first use, in whichever process reads

    def _encoded_image(self) -> bytes:
        if self._encoded is None:
            # Smooth gradients plus noise, HWC: compresses like a photo, not like all-zeros.
            s = self.source_size
            ramp = np.arange(s, dtype=np.float32) * (127.0 / s)
            base = ramp[:, None, None] + ramp[None, :, None]  # (s, s, 1)
            noise = np.random.default_rng([self.seed, 2**32 - 1]).integers(0, 32, (s, s, 3))
            self._encoded = zlib.compress(np.clip(base + noise, 0, 255).astype(np.uint8).tobytes(), level=6)
        return self._encoded

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        deadline = time.perf_counter() + self.decode_cost_ms / 1000.0
        self._check(index)
        rng = np.random.default_rng([self.seed, index])  # distinct, reproducible stream per sample
        raw = zlib.decompress(self._encoded_image())  # "decode": bytes -> uint8 pixels
        s, crop = self.source_size, self.image_size
        pixels = np.frombuffer(raw, dtype=np.uint8).reshape(s, s, 3)
        top, left = rng.integers(0, s - crop + 1, size=2)
        pixels = pixels[top:top + crop, left:left + crop]
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        image = pixels.astype(np.float32) * (rng.uniform(0.8, 1.2, size=3).astype(np.float32) / 255.0)
        image = ((image - _MEAN) / _STD).transpose(2, 0, 1)  # HWC -> CHW, like ToTensor
        if self.segmentation:
            # A mask that is a function of the pixels, so the task is learnable: C intensity bands.
            target = torch.from_numpy((pixels[..., 0].astype(np.int64) * self.classes) // 256)
        else:
            target = torch.tensor(int(rng.integers(self.classes)))
        _burn_until(deadline, raw)
        return torch.from_numpy(np.ascontiguousarray(image)), target


def _burn_until(deadline: float, payload: bytes) -> None:
    """Real CPU work (checksumming the decoded bytes) until `deadline` (perf_counter seconds)."""
    view = memoryview(payload)[: 64 * 1024]  # ~10-20 us per pass: fine-grained enough to hit the deadline
    while time.perf_counter() < deadline:
        zlib.crc32(view)
