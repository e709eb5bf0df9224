"""Train the embedded demo model shipped in ``mlx_kvq/demo/model``.

The model is a small mlx-lm ``gemma3_text`` (hybrid sliding-window / full attention)
trained from scratch on the King James Bible (public domain), read offline from
Debian's ``bible-kjv-text`` package through the ``bible`` reader of ``bible-kjv``::

    apt-get install -y bible-kjv bible-kjv-text
    pip install torch==2.13.0
    python scripts/train_demo.py

The forward pass is a PyTorch re-implementation of ``mlx_lm/models/gemma3_text.py``
with the same parameter names, so the trained weights load with ``mlx_lm.load``.
After training the script exports the model, tokenizer and held-out text, and checks
that the MLX model reproduces the PyTorch logits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

# One thread everywhere (the machine is shared); must be set before the imports below.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / "mlx_kvq" / "demo"

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PAD_ID, EOS_ID, BOS_ID, UNK_ID, SOT_ID, EOT_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- corpus


@dataclass
class Chapter:
    """One chapter of the KJV: book name, chapter number and its verses."""

    book: str
    number: int
    verses: list[str]

    def text(self) -> str:
        """Plain-text form used for training and evaluation: one verse per line."""
        return "\n".join(self.verses) + "\n"


def read_kjv(bible_cmd: str = "bible") -> list[Chapter]:
    """Decode the whole KJV from ``/usr/lib/bible.data`` with the ``bible`` reader."""
    exe = shutil.which(bible_cmd)
    if exe is None:
        raise SystemExit("`bible` not found: apt-get install -y bible-kjv bible-kjv-text")
    raw = subprocess.run(
        [exe, "-l100000", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True
    ).stdout
    chapters: list[Chapter] = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        verse = re.match(r"^\s+(\d+) (.*)$", line)
        if verse:
            chapters[-1].verses.append(verse.group(2).strip())
            continue
        head = re.match(r"^(\S.*) (\d+)$", line)
        if head is None:
            raise ValueError(f"unexpected line in bible output: {line!r}")
        chapters.append(Chapter(head.group(1), int(head.group(2)), []))
    n_verses = sum(len(c.verses) for c in chapters)
    if len(chapters) != 1189 or n_verses != 31102:
        raise ValueError(f"unexpected KJV size: {len(chapters)} chapters, {n_verses} verses")
    return chapters


def split_heldout(chapters: list[Chapter], frac: float) -> tuple[list[Chapter], list[Chapter]]:
    """Hold out the trailing whole books covering at most ``frac`` of the characters."""
    books: list[str] = list(dict.fromkeys(c.book for c in chapters))
    size = {b: sum(len(c.text()) for c in chapters if c.book == b) for b in books}
    total, held, acc = sum(size.values()), set(), 0
    for b in reversed(books):
        if acc + size[b] > frac * total:
            break
        acc += size[b]
        held.add(b)
    train = [c for c in chapters if c.book not in held]
    heldout = [c for c in chapters if c.book in held]
    return train, heldout


def chat_render(verses: list[str], rng: random.Random) -> str:
    """Render a chapter as a multi-turn chat: a verse asked, the next verses answered."""
    out, i = [], 0
    while i < len(verses):
        u = verses[i]
        n = rng.randint(1, 3)
        m = verses[i + 1 : i + 1 + n] or ["Amen."]
        out.append(f"<start_of_turn>user\n{u}<end_of_turn>\n")
        out.append("<start_of_turn>model\n" + "\n".join(m) + "<end_of_turn>\n")
        i += 1 + n
    return "".join(out)


def read_python_docs() -> tuple[list[list[str]], str]:
    """Modern technical English from this CPython's standard library (PSF License):
    every docstring of the library's modules (tests, ``site-packages`` and
    ``pydoc_data`` left out; doctest lines dropped) and the Language Reference
    topics of ``pydoc_data`` except the 18 that make ``modern.txt``, each split
    into paragraphs. Returns (documents, held-out text): the held-out text is
    ``modern.txt`` itself, which no training document contains."""
    import ast
    import pydoc_data.topics
    import sys

    from make_modern_text import TOPICS, prose

    def paragraphs(text: str) -> list[str]:
        keep = [ln for ln in text.splitlines() if not ln.lstrip().startswith((">>>", "... "))]
        paras = re.split(r"\n\s*\n", "\n".join(keep).strip())
        return [p.strip() for p in paras if p.strip()]

    docs: list[list[str]] = []
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    skip = {"site-packages", "test", "tests", "pydoc_data", "idle_test", "turtledemo"}
    for path in sorted(lib.rglob("*.py")):
        if skip & set(path.relative_to(lib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40 and (paras := paragraphs(doc)):
                    docs.append(paras)
    topics = pydoc_data.topics.topics
    for name in sorted(set(topics) - set(TOPICS)):
        if paras := paragraphs(prose(topics[name])):
            docs.append(paras)
    return docs, (DEMO_DIR / "modern.txt").read_text()


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with Gemma-like special tokens (<pad>=0, <eos>=1, <bos>=2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, t
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return tok


def save_tokenizer(tok, out: Path, max_length: int = 2048) -> None:
    """Write tokenizer.json, tokenizer_config.json (with chat template), special map."""
    tok.save(str(out / "tokenizer.json"))
    special = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
    }
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "added_tokens_decoder": added,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# -------------------------------------------------------------------------- model


@dataclass
class Gemma3Config:
    """The subset of mlx-lm's gemma3_text ModelArgs the demo model uses."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 6
    intermediate_size: int = 1024
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: int = 64
    sliding_window: int = 128
    sliding_window_pattern: int = 3
    max_position_embeddings: int = 2048

    # The maths that differ between the families the trainer knows.
    norm_offset = True  # (1 + w) RMSNorm, weights initialised to zero
    sandwich_norms = True
    activation = "gelu_tanh"

    def is_sliding(self, layer: int) -> bool:
        """Same rule as mlx-lm: every ``pattern``-th layer uses full attention."""
        return (layer + 1) % self.sliding_window_pattern != 0

    def window(self, layer: int) -> int | None:
        """Sliding-window length of ``layer``; None for full attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def rope_base(self, layer: int) -> float:
        return self.rope_local_base_freq if self.is_sliding(layer) else self.rope_theta

    def attn_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def embed_scale(self) -> float:
        """mlx-lm multiplies the embeddings by sqrt(hidden) rounded to bfloat16."""
        return float(torch.tensor(self.hidden_size**0.5, dtype=torch.bfloat16))

    def hf_config(self, dtype: str) -> dict:
        """config.json contents for mlx-lm (plus HF-style informative fields)."""
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            **asdict(self),
            "rope_scaling": None,
            "layer_types": [
                "sliding_attention" if self.is_sliding(i) else "full_attention"
                for i in range(self.num_hidden_layers)
            ],
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "tie_word_embeddings": True,
            "bos_token_id": BOS_ID,
            "eos_token_id": [EOS_ID, EOT_ID],
            "pad_token_id": PAD_ID,
            "torch_dtype": dtype,
        }


@dataclass
class Qwen3Config:
    """mlx-lm's qwen3 ModelArgs: full attention on every layer, q/k RMSNorm, SwiGLU."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    intermediate_size: int = 512
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 1024

    norm_offset = False  # plain RMSNorm, weights initialised to one
    sandwich_norms = False
    activation = "silu"

    def window(self, layer: int) -> int | None:
        return None

    def rope_base(self, layer: int) -> float:
        return self.rope_theta

    def attn_scale(self) -> float:
        return self.head_dim**-0.5

    def embed_scale(self) -> float:
        return 1.0

    def hf_config(self, dtype: str) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **asdict(self),
            "rope_scaling": None,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": True,
            "bos_token_id": BOS_ID,
            "eos_token_id": [EOS_ID, EOT_ID],
            "pad_token_id": PAD_ID,
            "torch_dtype": dtype,
        }


ModelConfig = Gemma3Config | Qwen3Config


class RMSNorm(nn.Module):
    """RMSNorm: ``x / rms(x) * (1 + weight)`` (Gemma, weight from zero) or ``* weight``."""

    def __init__(self, dim: int, eps: float, offset: bool) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


def rope_tables(L: int, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for MLX's non-traditional RoPE (rotate-half layout)."""
    inv = base ** (-torch.arange(0, dim // 2, dtype=torch.float64) / (dim // 2))
    ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (B, H, L, D) with the half-split convention."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class Attention(nn.Module):
    """GQA attention with q/k RMSNorm over the head dimension (both families)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.scale = cfg.attn_scale()
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.hd).transpose(1, 2)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    """Gated MLP: GELU-tanh (Gemma) or SiLU (SwiGLU, Qwen3)."""

    def __init__(self, d: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.act = {"gelu_tanh": partial(F.gelu, approximate="tanh"), "silu": F.silu}[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm block; Gemma3 adds post-norms around attention and MLP (sandwich)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.sandwich = cfg.sandwich_norms
        self.self_attn = Attention(cfg)
        self.mlp = MLP(d, cfg.intermediate_size, cfg.activation)
        self.input_layernorm = RMSNorm(d, eps, off)
        self.post_attention_layernorm = RMSNorm(d, eps, off)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, off)
            self.post_feedforward_layernorm = RMSNorm(d, eps, off)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), mask, cos, sin)
        if not self.sandwich:
            h = x + a
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Inner(nn.Module):
    """``model.*`` parameters: embeddings, layers and the final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


class CausalLM(nn.Module):
    """PyTorch twin of mlx-lm's gemma3_text or qwen3 ``Model`` with tied embeddings."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.embed_scale = cfg.embed_scale()
        self._tables: dict[int, list[tuple[torch.Tensor, ...]]] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, residual output projections scaled down by depth."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                s = (
                    std / math.sqrt(2 * self.cfg.num_hidden_layers)
                    if (name.endswith("o_proj.weight") or name.endswith("down_proj.weight"))
                    else std
                )
                nn.init.normal_(p, 0.0, s)

    def tables(self, L: int) -> list[tuple[torch.Tensor, ...]]:
        """(mask, cos, sin) of every layer for length ``L`` (cached)."""
        if L not in self._tables:
            c = self.cfg
            i = torch.arange(L)[:, None]
            j = torch.arange(L)[None]
            out = []
            for layer in range(c.num_hidden_layers):
                w = c.window(layer)
                mask = (j <= i) if w is None else (j <= i) & (i < j + w)
                out.append((mask, *rope_tables(L, c.head_dim, c.rope_base(layer))))
            self._tables[L] = out
        return self._tables[L]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, L, vocab) for token ids of shape (B, L)."""
        h = self.model.embed_tokens(ids) * self.embed_scale
        for layer, (mask, cos, sin) in zip(
            self.model.layers, self.tables(ids.shape[1]), strict=True
        ):
            h = layer(h, mask, cos, sin)
        h = self.model.norm(h)
        return h @ self.model.embed_tokens.weight.to(h.dtype).T


# ----------------------------------------------------------------------- training


def windows(stream: np.ndarray, starts: np.ndarray, L: int) -> torch.Tensor:
    """Rows of ``[<bos>] + stream[s : s + L - 1]`` for each start ``s``."""
    idx = starts[:, None] + np.arange(L - 1)[None]
    rows = np.concatenate([np.full((len(starts), 1), BOS_ID), stream[idx]], axis=1)
    return torch.from_numpy(rows.astype(np.int64))


@torch.no_grad()
def mean_loss(model: CausalLM, stream: np.ndarray, L: int, max_windows: int, bs: int) -> float:
    """Mean next-token loss over evenly spaced windows of ``stream``."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // (L - 1))
    starts = np.arange(n) * (L - 1)
    tot, cnt = 0.0, 0
    for b in range(0, n, bs):
        x = windows(stream, starts[b : b + bs], L + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def build_streams(
    tok, train: list[list[str]], heldout: str, sep: str, chat_frac: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token streams: each training document (its units joined by ``sep``, or as chat
    with prob ``chat_frac``) + <eos>; the held-out text as one stream."""
    rng = random.Random(seed)
    texts = [chat_render(d, rng) if rng.random() < chat_frac else sep.join(d) + "\n" for d in train]
    enc = tok.encode_batch(texts, add_special_tokens=False)
    train_ids = np.concatenate([np.array(e.ids + [EOS_ID], dtype=np.int32) for e in enc])
    held_ids = np.array(tok.encode(heldout, add_special_tokens=False).ids, dtype=np.int32)
    return train_ids, held_ids


def train(
    args: argparse.Namespace, cfg: ModelConfig, train_ids: np.ndarray, held_ids: np.ndarray
) -> tuple[CausalLM, dict]:
    """Train from a fixed seed for ``args.steps`` steps; returns model and metrics."""
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = CausalLM(cfg)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=False,
    )
    L = args.seq_len
    t0, c0 = time.time(), time.process_time()
    ema = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = rng.integers(0, len(train_ids) - L, size=args.batch_size)
        x = windows(train_ids, starts, L + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t0
            tps = (step + 1) * args.batch_size * L / el
            print(
                f"step {step:5d} loss {loss.item():.3f} ema {ema:.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {el / 60:.1f} min "
                f"(cpu {(time.process_time() - c0) / 60:.1f} min) {tps:.0f} tok/s",
                flush=True,
            )
        if args.eval_every and step and step % args.eval_every == 0:
            hl = mean_loss(model, held_ids, L, 16, args.batch_size)
            print(f"  held-out loss {hl:.3f} ppl {math.exp(hl):.1f}", flush=True)
    train_time, cpu_time = time.time() - t0, time.process_time() - c0
    tl = mean_loss(model, train_ids, L, 64, args.batch_size)
    hl = mean_loss(model, held_ids, L, 10_000, args.batch_size)
    metrics = {
        "train_loss": tl,
        "heldout_loss": hl,
        "heldout_ppl": math.exp(hl),
        "train_minutes": train_time / 60,
        "train_cpu_minutes": cpu_time / 60,
        "train_tokens": args.steps * args.batch_size * L,
    }
    print(
        f"final train loss {tl:.3f} (ppl {math.exp(tl):.1f}); held-out loss {hl:.3f} "
        f"(ppl {math.exp(hl):.1f}); {train_time / 60:.1f} min wall, {cpu_time / 60:.1f} min cpu",
        flush=True,
    )
    return model, metrics


# ------------------------------------------------------------------ export / check


def export(model: CausalLM, out: Path, dtype: str) -> None:
    """Write config.json and model.safetensors with mlx-lm parameter names."""
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
    tensors = {
        k: v.detach().float().numpy().astype(np_dtype) for k, v in model.state_dict().items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(model.cfg.hf_config(dtype), indent=2) + "\n")


def mlx_parity(model: CausalLM, model_dir: Path, ids: list[int]) -> tuple[float, float]:
    """Max |logit diff| between mlx_lm.load(model_dir) and PyTorch (fp32), argmax agreement."""
    import mlx.core as mx
    from mlx_lm import load

    mlx_model, _ = load(str(model_dir))
    out = mlx_model(mx.array([ids]))
    got = np.array(out.astype(mx.float32))[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).float().numpy()[0]
    return float(np.abs(got - ref).max()), float((got.argmax(-1) == ref.argmax(-1)).mean())


def mlx_checks(model: CausalLM, out: Path, held_text: str, prompts: list[str]) -> dict:
    """Parity (fp32 and shipped dtype), tokenizer/chat checks, samples, MLX perplexity."""
    import mlx.core as mx
    from mlx_lm import generate, load

    model = model.float().eval()
    _, tokenizer = load(str(out))
    ids = tokenizer.encode(held_text)[:512]
    assert ids[0] == BOS_ID and len(ids) == 512
    with tempfile.TemporaryDirectory() as tmp:
        for f in out.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, tmp)
        export(model, Path(tmp), "float32")
        d32, a32 = mlx_parity(model, Path(tmp), ids)
    d16, a16 = mlx_parity(model, out, ids)
    print(
        f"MLX vs PyTorch logits over 512 tokens: float32 max|diff| {d32:.2e} "
        f"(argmax agree {a32:.3f}); shipped max|diff| {d16:.2e} (argmax agree {a16:.3f})"
    )
    assert d32 < 1e-2 and a32 > 0.99, "float32 MLX export does not match PyTorch"
    assert d16 < 0.25 and a16 > 0.97, "shipped MLX weights drift too far from PyTorch"

    mlx_model, tokenizer = load(str(out))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    print("chat prompt ids:", chat, "eos ids:", sorted(tokenizer.eos_token_ids))
    assert chat[0] == BOS_ID and chat.count(BOS_ID) == 1
    assert tokenizer.decode(chat).endswith("<start_of_turn>model\n")
    assert {EOS_ID, EOT_ID} <= set(tokenizer.eos_token_ids)

    # Perplexity on the first 256 held-out tokens, as tests/test_demo_model.py does.
    x = mx.array([ids[:256]])
    logits = mlx_model(x[:, :-1]).astype(mx.float32)
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, 1:, None], -1)[..., 0]
    ppl256 = float(mx.exp(nll.mean()))
    print(f"MLX held-out ppl (first 256 tokens of the held-out text): {ppl256:.2f}")

    samples = {}
    for prompt in prompts:
        samples[prompt] = generate(mlx_model, tokenizer, prompt, max_tokens=40)
        print(f"--- {prompt!r} -> {samples[prompt]!r}")
    chat_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is love?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    samples["chat: What is love?"] = generate(mlx_model, tokenizer, chat_prompt, max_tokens=60)
    print(f"--- chat 'What is love?' -> {samples['chat: What is love?']!r}")
    return {
        "mlx_fp32_max_abs_diff": d32,
        "mlx_shipped_max_abs_diff": d16,
        "mlx_heldout_ppl_256": ppl256,
        "samples": samples,
    }


# --------------------------------------------------------------------------- main


@dataclass(frozen=True)
class Preset:
    """What one shipped model is: its architecture, corpus and training defaults."""

    config: type
    corpus: str
    out: Path
    steps: int
    batch_size: int
    seq_len: int
    warmup: int
    lr: float
    threads: int
    prompts: tuple[str, ...]


PRESETS = {
    # The demo model (demo:gemma): hybrid sliding-window/full attention, KJV.
    "gemma": Preset(
        Gemma3Config, "kjv", DEMO_DIR / "model", 900, 8, 512, 100, 2e-3, 1,
        ("And God said", "In the beginning", "Blessed are the"),
    ),
    # The judge model (demo:full): qwen3, full attention on every layer, Python docs.
    "full": Preset(
        Qwen3Config, "python-docs", DEMO_DIR / "full", 520, 4, 1024, 10, 2.5e-3, 2,
        ("The function returns", "An exception is raised when", "This module provides"),
    ),
}  # fmt: skip


def main() -> None:
    """Parse arguments, build the corpus and tokenizer, train, export and verify."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="gemma")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--heldout-out", type=Path, default=DEMO_DIR / "heldout.txt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-frac", type=float, default=0.05)
    p.add_argument("--chat-frac", type=float, default=0.1)
    p.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    p.add_argument(
        "--no-bf16",
        dest="bf16",
        action="store_false",
        help="train in float32 instead of bfloat16 autocast",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (OMP_NUM_THREADS follows)"
    )
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    args = p.parse_args()
    preset = PRESETS[args.model]
    for name in ("out", "steps", "batch_size", "seq_len", "warmup", "lr", "threads"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    random.seed(args.seed)

    if preset.corpus == "kjv":
        chapters = read_kjv()
        train_ch, held_ch = split_heldout(chapters, args.heldout_frac)
        held_text = "\n".join(c.text() for c in held_ch)
        print(
            f"KJV: {len(chapters)} chapters; held out {len(held_ch)} chapters of "
            f"{held_ch[0].book}..{held_ch[-1].book} ({len(held_text) / 1e3:.0f} kB)"
        )
        docs, sep = [c.verses for c in train_ch], "\n"
    else:
        docs, held_text = read_python_docs()
        sep = "\n\n"
        chars = sum(len(sep.join(d)) for d in docs)
        print(f"Python docs: {len(docs)} documents, {chars / 1e3:.0f} kB; held out modern.txt")

    tok = train_tokenizer([sep.join(d) + "\n" for d in docs], args.vocab_size)
    train_ids, held_ids = build_streams(tok, docs, held_text, sep, args.chat_frac, args.seed)
    print(f"tokens: train {len(train_ids)}, held-out {len(held_ids)}")

    cfg = preset.config(vocab_size=tok.get_vocab_size())
    n_params = sum(p.numel() for p in CausalLM(cfg).parameters())
    print(f"model: {cfg}\nparameters: {n_params / 1e6:.2f}M", flush=True)

    model, metrics = train(args, cfg, train_ids, held_ids)

    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    save_tokenizer(tok, args.out, cfg.max_position_embeddings)
    export(model, args.out, args.dtype)
    if preset.corpus == "kjv":
        args.heldout_out.write_text(held_text)
    metrics.update(mlx_checks(model, args.out, held_text, list(preset.prompts)))
    metrics.update(
        model=args.model,
        params=n_params,
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
    )
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
