"""Bidirectional transformer encoders for the bert-* and vit-* presets.

Repeated blocks live in `self.blocks` (an nn.ModuleList), as in the decoders.
"""

from __future__ import annotations

import torch
from torch import nn

from advisor.presets.layers import TransformerBlock, init_normal


class BertMLM(nn.Module):
    """BERT (Devlin et al. 2018) with its masked-LM head; post-LayerNorm blocks, exact GELU.

    forward(input_ids (B, T) int64) -> logits (B, T, V). The decoder is tied to the word embedding.
    """

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, max_positions: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(2, hidden)  # segment A/B; every synthetic sample is segment A
        self.emb_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.blocks = nn.ModuleList(
            TransformerBlock(hidden, heads, 4 * hidden, causal=False, pre_norm=False, eps=1e-12)
            for _ in range(layers)
        )
        # MLM head: dense -> GELU -> LayerNorm -> tied decoder + per-token bias.
        self.head_dense = nn.Linear(hidden, hidden)
        self.head_act = nn.GELU()
        self.head_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab)
        self.apply(init_normal)
        self.decoder.weight = self.word.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(pos) + self.token_type.weight[0]
        x = self.emb_norm(x)
        for block in self.blocks:
            x = block(x)
        return self.decoder(self.head_norm(self.head_act(self.head_dense(x))))


class ViT(nn.Module):
    """Vision Transformer (Dosovitskiy et al. 2020): patchify conv, class token, pre-LN blocks.

    forward(images (B, 3, S, S)) -> logits (B, classes).
    """

    def __init__(self, image_size: int, patch: int, layers: int, hidden: int, heads: int, classes: int) -> None:
        super().__init__()
        tokens = (image_size // patch) ** 2 + 1  # patches plus the class token: 197 at 224 px / 16
        self.patch_embed = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, hidden) * 0.02)
        self.blocks = nn.ModuleList(
            TransformerBlock(hidden, heads, 4 * hidden, causal=False, pre_norm=True, eps=1e-6)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, C)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))
