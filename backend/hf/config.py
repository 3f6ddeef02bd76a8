"""Hugging Face Llama and Mixtral configs: `read_config(dir)` reads and checks a model directory's
config.json (a Llama or a Mixtral this project can run, else one HFError line), `spec_from_config`
turns it into a ModelSpec and `config_from_spec` writes one back for an export.

A Mixtral is a Llama whose every block has a sparse MoE block in place of the MLP: num_local_experts
experts (SwiGLU, intermediate_size wide), num_experts_per_tok of them per token, dropless, and the
router's load-balancing loss weighted by router_aux_loss_coef."""

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
    experts: int = 0         # Mixtral: num_local_experts (0: a dense Llama)
    top_k: int = 0           # Mixtral: num_experts_per_tok
    aux_coef: float = 0.0    # Mixtral: router_aux_loss_coef


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
    arch = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}.get(kind)
    if arch is None or (archs and arch not in archs):
        what = f"{kind!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
        raise HFError(f"{path} describes a {what} model, not a Llama or a Mixtral (model_type \"llama\" or "
                      "\"mixtral\"): only Llama and Mixtral checkpoints can be imported")

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

    moe = {}
    if kind == "mixtral":
        experts, top_k = count("num_local_experts", 8), count("num_experts_per_tok", 2)
        if top_k > experts:
            raise HFError(f"{path}: num_experts_per_tok {top_k} is above num_local_experts {experts}")
        coef = raw.get("router_aux_loss_coef", 0.001)
        if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
            raise HFError(f"{path}: router_aux_loss_coef must be a number >= 0, got {coef!r}")
        if raw.get("router_jitter_noise") not in (None, 0, 0.0):
            raise HFError(f"{path}: router_jitter_noise {raw['router_jitter_noise']!r} is not supported "
                          "(this project's router has no noise): set it to 0.0 in config.json")
        window = raw.get("sliding_window")
        if window is not None and (not isinstance(window, int) or window < count("max_position_embeddings", 2048)):
            raise HFError(f"{path}: a sliding attention window ({window!r}) is not supported: set sliding_window "
                          "to null (or at least max_position_embeddings)")
        moe = {"experts": experts, "top_k": top_k, "aux_coef": float(coef)}
    return LlamaConfig(**moe, layers=count("num_hidden_layers"), hidden=hidden, heads=heads,
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
    moe = {}
    if cfg.experts:  # Mixtral: every block MoE, dropless, its router's loss coefficient
        moe = {"experts": cfg.experts, "top_k": cfg.top_k, "moe_every": 1, "capacity_factor": 0.0,
               "router_aux_coef": cfg.aux_coef}
    try:
        return ModelSpec(name=name, arch="llama", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                         kv_heads=cfg.kv_heads, ffn_size=cfg.ffn, vocab=cfg.vocab,
                         seq_len=seq_len or min(cfg.max_positions, 2048), global_batch=global_batch,
                         rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, tied_embeddings=False, **rope, **moe)
    except TwinError as e:
        raise HFError(f"{name}: {e}") from None


def config_from_spec(spec: ModelSpec, base: dict | None = None, dtype: str = "float32") -> dict:
    """A Llama (or, for a MoE spec, Mixtral) config.json for `spec`: `base` (the config it was
    imported from) with its sizes set from the spec, an untied head and the weights' dtype."""
    experts = int(getattr(spec, "experts", 0) or 0)
    if experts and int(getattr(spec, "moe_every", 1)) != 1:
        raise HFError(f"{spec.name}: MoE on every {spec.moe_every}th block only: a Hugging Face Mixtral has "
                      "an MoE block in every layer (moe_every = 1)")
    cfg = dict(base or {})
    if (cfg.get("model_type") == "mixtral") != bool(experts):
        cfg = {}  # the base of another kind of model: start afresh
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
    if experts:
        cfg.pop("mlp_bias", None)
        cfg.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
                    "num_experts_per_tok": int(spec.top_k), "router_aux_loss_coef": float(spec.router_aux_coef),
                    "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False})
    return cfg

