"""Hugging Face Llama configs: `read_config(dir)` reads and checks a model directory's config.json (a
Llama this project can run, else one HFError line), `spec_from_config` turns it into a ModelSpec and
`config_from_spec` writes one back for an export."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from topologies.common import TwinError

if TYPE_CHECKING:
    from twin.program.model import ModelSpec

CONFIG = "config.json"


class HFError(TwinError):
    """A Hugging Face directory or checkpoint that cannot be imported or exported."""



@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama config.json this project uses (sizes are counts)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_positions: int
    rope_theta: float
    norm_eps: float
    tied: bool
    rope_scaling: dict | None  # the "llama3" frequency scaling of Llama 3.1+, or None
    bos: int | None
    eos: int | None
    raw: dict


def read_config(hf_dir: str | Path) -> LlamaConfig:
    """The Llama config of a Hugging Face model directory (raises HFError with one clear line)."""
    path = Path(hf_dir) / CONFIG
    if not Path(hf_dir).is_dir():
        raise HFError(f"{hf_dir} is not a folder: give a Hugging Face model directory (config.json and *.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{hf_dir} has no config.json: give a Hugging Face model directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HFError(f"{path} is not a JSON object")
    kind = raw.get("model_type")
    archs = raw.get("architectures") or []
    if kind != "llama" or (archs and "LlamaForCausalLM" not in archs):
        what = f"{kind!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
        raise HFError(f"{path} describes a {what} model, not a Llama (model_type \"llama\", LlamaForCausalLM): "
                      "only Llama checkpoints can be imported")

    def count(key: str, default=None) -> int:
        v = raw.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise HFError(f"{path}: {key} must be a positive integer, got {v!r}")
        return v

    heads = count("num_attention_heads")
    hidden = count("hidden_size")
    if raw.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise HFError(f"{path}: head_dim {raw.get('head_dim')} is not hidden_size / num_attention_heads "
                      f"({hidden} / {heads}): such Llamas are not supported")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, want) != want:
            raise HFError(f"{path}: {key} is {raw[key]!r}; this project's Llama has {want!r}")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise HFError(f"{path}: rope scaling {kind!r} is not supported (only Llama 3's \"llama3\")")
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    eps = raw.get("rms_norm_eps", 1e-6)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (theta, eps)):
        raise HFError(f"{path}: rope_theta and rms_norm_eps must be positive numbers, got {theta!r} and {eps!r}")

    def token(key):
        v = raw.get(key)
        v = v[0] if isinstance(v, list) and v else v
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return LlamaConfig(layers=count("num_hidden_layers"), hidden=hidden, heads=heads,
                       kv_heads=count("num_key_value_heads", heads), ffn=count("intermediate_size"),
                       vocab=count("vocab_size"), max_positions=count("max_position_embeddings", 2048),
                       rope_theta=float(theta), norm_eps=float(eps), tied=bool(raw.get("tie_word_embeddings", False)),
                       rope_scaling=scaling, bos=token("bos_token_id"), eos=token("eos_token_id"), raw=raw)


def spec_from_config(cfg: LlamaConfig, name: str, seq_len: int | None = None, global_batch: int = 8) -> ModelSpec:
    """The ModelSpec of a Llama config. seq_len: training sequence length (default: the config's
    max_position_embeddings, at most 2048); global_batch: sequences per step."""
    from twin.program.model import ModelSpec

    if seq_len is not None and not 1 <= seq_len <= cfg.max_positions:
        raise HFError(f"--seq-len {seq_len} must be in 1..{cfg.max_positions} (the model's max_position_embeddings)")
    rope = {}
    if cfg.rope_scaling:
        s = cfg.rope_scaling
        rope = {"rope_scaling": float(s.get("factor", 8.0)), "rope_low_freq_factor": float(s.get("low_freq_factor", 1.0)),
                "rope_high_freq_factor": float(s.get("high_freq_factor", 4.0)),
                "rope_original_context": int(s.get("original_max_position_embeddings", 8192))}
    try:
        return ModelSpec(name=name, arch="llama", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                         kv_heads=cfg.kv_heads, ffn_size=cfg.ffn, vocab=cfg.vocab,
                         seq_len=seq_len or min(cfg.max_positions, 2048), global_batch=global_batch,
                         rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, tied_embeddings=False, **rope)
    except TwinError as e:
        raise HFError(f"{name}: {e}") from None


def config_from_spec(spec: ModelSpec, base: dict | None = None, dtype: str = "float32") -> dict:
    """A Llama config.json for `spec`: `base` (the config it was imported from) with its sizes set
    from the spec, an untied head and the weights' dtype."""
    cfg = dict(base or {})
    for key in ("quantization_config", "auto_map", "_name_or_path"):
        cfg.pop(key, None)
    cfg.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden,
                "intermediate_size": spec.ffn, "num_hidden_layers": spec.layers,
                "num_attention_heads": spec.heads, "num_key_value_heads": spec.n_kv_heads,
                "head_dim": spec.head_dim, "vocab_size": spec.vocab, "rms_norm_eps": spec.norm_eps,
                "rope_theta": spec.rope_theta, "tie_word_embeddings": False, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype})
    cfg.setdefault("max_position_embeddings", spec.seq_len)
    scaling = None
    if spec.rope_scaling:
        scaling = {"rope_type": "llama3", "factor": spec.rope_scaling, "low_freq_factor": spec.rope_low_freq_factor,
                   "high_freq_factor": spec.rope_high_freq_factor,
                   "original_max_position_embeddings": spec.rope_original_context}
    cfg["rope_scaling"] = scaling
    cfg["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": spec.rope_theta}
    return cfg

