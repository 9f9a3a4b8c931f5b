"""LoRA test helpers: PEFT adapters made in the test (``peft``'s ``get_peft_model`` on a copy of
the tiny HF model, random non-zero ``lora_B``, ``save_pretrained``), the PEFT merged reference
(``merge_and_unload``), and our engine's logits per request (``helpers.record``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from helpers import greedy, record

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, out_dir: Path, seed: int, r: int = 8, alpha: int = 16, targets=None,
                 use_rslora: bool = False, scale: float = 0.15) -> Path:
    """A PEFT LoRA adapter of ``hf_model`` (a copy: the model is untouched) in ``out_dir``, with
    random ``lora_A`` and ``lora_B`` (peft starts B at zero: the adapter would be a no-op);
    ``targets``: peft's ``target_modules`` (default every projection)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                     use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_model(hf_model, adapter_dir: Path):
    """PEFT's merged model (``merge_and_unload``) of ``hf_model`` plus the adapter, fp32, eval."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter_dir)).merge_and_unload().eval()


@torch.no_grad()
def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF fp32 logits ``[len(token_ids), vocab]`` of one sequence (teacher forcing)."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def engine_run(llm, prompts, n: int, lora_requests):
    """Greedy ``n`` tokens of each prompt (token-id lists) with its adapter, in one batch:
    ``[(prompt + generated ids, logits [n, vocab] of each sampled step)]``."""
    with record(llm) as rec:
        outs = llm.generate([list(p) for p in prompts], greedy(n), lora_request=lora_requests, use_tqdm=False)
    result = []
    for p, out in zip(prompts, outs):
        steps = [s["logits"] for s in rec.by_request[out.request_id] if s["logits"] is not None]
        result.append((list(p) + list(out.token_ids), torch.stack(steps)))
    return result


def edit_adapter_config(adapter_dir: Path, **changes) -> None:
    """Rewrite fields of ``adapter_config.json`` (to build a bad adapter)."""
    path = adapter_dir / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
