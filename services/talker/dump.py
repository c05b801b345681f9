"""Fidelity dump: the Talker arrays of the numerical oracle, produced by this service's own code path.

``python -m services.talker dump --checkpoint DIR --out FILE.npz`` writes the ``talker.*`` keys the
reference harness writes (docs/fidelity.md, Dump keys), for the same fixed condition:

* the first 10 token ids of :data:`CONDITION_TEXT` under the checkpoint tokenizer;
* 10 hidden rows drawn N(0, 1) in fp32 from a CPU ``torch.Generator`` whose seed is the first 8 bytes
  (little endian, top bit cleared) of ``sha256(f"{seed}/talker_hidden")``.

``--reference REF.npz`` instead takes ``talker.cond_token_ids`` / ``talker.cond_hidden`` from an oracle
file. The arrays then come from the engine itself (whole-utterance turn, greedy draw, temperature 1,
no repetition penalty, EOS masked for the first 50 steps), with the raw logits tapped before sampling.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from services.common.checkpoint import Checkpoint
from services.talker.engine import TalkerEngine
from services.talker.model.tts import MiniCPMTTS
from services.talker.streams import ConditionInput, DoneOut, WindowOut

CONDITION_TEXT = "Hello there, this sentence conditions the talker oracle run."
CONDITION_LEN = 10
GREEDY_STEPS = 30


def derived_seed(seed: int, tag: str) -> int:
    digest = hashlib.sha256(f"{seed}/{tag}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def oracle_condition(ckpt: Checkpoint, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Regenerate the oracle's fixed condition (token ids [10], hidden [10, llm_dim] fp32)."""
    tok = ckpt.tokenizer()
    ids = tok.encode(CONDITION_TEXT, add_special_tokens=False)[:CONDITION_LEN]
    if len(ids) < CONDITION_LEN:
        raise SystemExit("condition text tokenised to fewer than 10 ids")
    gen = torch.Generator(device="cpu").manual_seed(derived_seed(seed, "talker_hidden"))
    hidden = torch.randn(CONDITION_LEN, int(ckpt.config["hidden_size"]), generator=gen, dtype=torch.float32)
    return torch.tensor(ids, dtype=torch.long), hidden


def run_dump(
    ckpt: Checkpoint,
    token_ids: torch.Tensor,
    hidden: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    steps: int = GREEDY_STEPS,
) -> dict[str, np.ndarray]:
    model = MiniCPMTTS.from_checkpoint(ckpt, dtype=dtype, device=device)
    engine = TalkerEngine(model, max_streams=1)
    step_logits: list[torch.Tensor] = []
    engine.logits_observer = lambda _st, logits: step_logits.append(logits.detach().float().cpu().clone())
    outputs: list[object] = []
    settings = engine.make_settings(
        sampling=engine.default_sampling(temperature=1.0, repetition_penalty=1.0, greedy=True),
        fixed_frames=steps,
        window_frames=steps,
    )
    st = engine.open(settings, outputs.append)
    engine.chunk(st, ConditionInput(token_ids, hidden, True, False, 0, 0, 0))
    engine.end(st)
    engine.run_until_idle()
    codes: list[int] = []
    for out in outputs:
        if isinstance(out, WindowOut):
            codes.extend(out.window.codes[out.window.left_context :])
    if not any(isinstance(o, DoneOut) for o in outputs) or len(codes) != steps:
        raise RuntimeError(f"dump run produced {len(codes)} codes, expected {steps}: {outputs[-1:]}")
    cond = model.whole_utterance_condition(token_ids, hidden).float().cpu()
    logits = torch.stack(step_logits[:steps])
    masked = logits.clone()
    masked[:, model.cfg.eos_id] = float("-inf")
    top2 = masked.topk(2, dim=-1).values
    return {
        "talker.cond_token_ids": token_ids.to(torch.int64).numpy(),
        "talker.cond_hidden": hidden.float().numpy(),
        "talker.cond_embeds": cond.numpy(),
        "talker.step0_logits": logits[0].numpy(),
        "talker.greedy_codes": np.asarray(codes, dtype=np.int64),
        "talker.greedy_step_logits": logits.numpy(),
        "talker.greedy_margins": (top2[:, 0] - top2[:, 1]).numpy(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.talker dump", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference", help="take talker.cond_token_ids/cond_hidden from this oracle .npz")
    ap.add_argument("--seed", type=int, default=0, help="oracle input seed (not the weights)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=GREEDY_STEPS)
    args = ap.parse_args(argv)
    ckpt = Checkpoint(args.checkpoint)
    if args.reference:
        ref = np.load(args.reference)
        ids = torch.from_numpy(ref["talker.cond_token_ids"].astype(np.int64))
        hidden = torch.from_numpy(ref["talker.cond_hidden"].astype(np.float32))
    else:
        ids, hidden = oracle_condition(ckpt, args.seed)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    arrays = run_dump(ckpt, ids, hidden, dtype=dtype, device=args.device, steps=args.steps)
    meta = {"stage": "talker", "checkpoint": str(ckpt.root), "dtype": args.dtype, "device": args.device}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, meta_json=np.asarray(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    print(f"wrote {args.out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items()))
