"""Any model of transformers' catalogue, built small from its config class, and checked.

``build(model_type)`` makes a random-weight model of a transformers model type from its default
config, shrunk generically (widths, layers, heads, vocabularies, positions, image sizes; dropout
off, so that a train-mode step is deterministic), with the head the auto-model mappings list
first for it (causal LM, masked LM, seq2seq, image or sequence classification, else the bare
model). ``inputs_for`` makes inputs from the forward's signature. ``check`` runs one system
(keraunos.jit, torch.compile, torch.compile with keraunos's backend) on a copy of the model: an
eval forward twice, then two training steps with SGD, each compared with a float64 run of the
same model; a value passes when its error against float64 is at most ``TOLERANCE`` times eager
float32's own (plus a floor for values eager gets exactly; a value eager float32 gets wrong by
more than its own size is counted, not judged). ``benchmarks/sweep.py`` runs this
for every model type, each in a process of its own.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

BATCH, SEQUENCE, IMAGE, VOCAB = 2, 8, 32, 128
TOLERANCE = 3.0   # a system's error against float64 may be this many times eager float32's
FLOOR = 1e-6      # relative to the reference's scale: where eager float32 is (nearly) exact

# Config attributes by what they size, matched on the name (sub-configs are shrunk alike).
_LAYERS = re.compile(r"^(num_(hidden_)?layers|n_layers?|num_(encoder|decoder)_layers|"
                     r"(encoder|decoder)_layers|num_blocks|depth)$")
_HEADS = re.compile(r"^(num_attention_heads|n_heads?|num_heads|(encoder|decoder)_attention_heads)$")
_WIDTHS = re.compile(r"^(hidden_size|d_model|n_embd|embed_dim|dim|word_embed_proj_dim)$")
_FFN = re.compile(r"^(intermediate_size|ffn_dim|(encoder|decoder)_ffn_dim|d_ff|n_inner|"
                  r"moe_intermediate_size|shared_expert_intermediate_size)$")
_POSITIONS = re.compile(r"^(max_position_embeddings|n_positions|max_seq_len|seq_length|"
                        r"max_source_positions|max_target_positions)$")
AUDIO_SAMPLES = 1600  # raw audio (``input_values``): 0.1 s at 16 kHz
_TOKEN_IDS = re.compile(r"_token_id$")
_DROPOUT = re.compile(r"(dropout|_prob|drop_rate|layerdrop|drop_path_rate)")

# The heads tried for a model type, in order: the first the type has is built.
_HEADS_IN_ORDER = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                   "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                   "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                   "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_MAPPING_NAMES")


@dataclass
class Built:
    """A small model of one type, and what to call it with."""

    model_type: str
    model: torch.nn.Module
    head: str                      # the class built
    inputs: Callable[[int, bool], dict]  # (seed, with labels) -> forward's keyword arguments


def model_types() -> list[str]:
    """Every model type transformers' auto-config knows, in its own order."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return list(CONFIG_MAPPING_NAMES)


def shrink(config, stages: bool = True) -> None:
    """``config`` made small, in place (and its sub-configs): see the module docstring.
    ``stages``: per-stage depths to one block each (else kept)."""
    name = _layer_count_name(config)
    layers_before = getattr(config, name) if name else None
    for name, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            shrink(value, stages)
            continue
        if type(value) is bool or not isinstance(value, (int, float, list, tuple)):
            continue
        new = _small(name, value, config, stages)
        if new is not value:
            try:
                setattr(config, name, new)
            except (AttributeError, ValueError, TypeError):
                pass
    own = vars(config)  # (a heterogeneous config refuses to read per-layer attributes)
    if own.get("num_key_value_heads"):
        # (latent attention's keys and values have every head)
        config.num_key_value_heads = own.get("num_attention_heads") \
            if own.get("kv_lora_rank") else min(own["num_key_value_heads"], 2)
    if "head_dim" in own and own["head_dim"] != 0:
        config.head_dim = 8  # widths 32 over 4 heads (HunYuan leaves it None, and needs it)
    if "num_experts_per_tok" in own and own["num_experts_per_tok"] is None and (
            own.get("n_routed_experts") or own.get("num_experts")):
        config.num_experts_per_tok = 2  # no default (DeepSeek-V2): the router needs one
    if getattr(config, "qk_head_dim", None) and getattr(config, "qk_rope_head_dim", None):
        # derived when the config was made (DeepSeek's latent attention)
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if isinstance(getattr(config, "layer_types", None), list):
        # one layer of each kind the model has (Qwen3.5's linear and full attention), in order
        kinds = list(dict.fromkeys(config.layer_types))
        name = _layer_count_name(config)
        if name is not None:
            layers = max(getattr(config, name), len(kinds))
            setattr(config, name, layers)
            config.layer_types = (kinds + list(config.layer_types))[:layers]
    name = _layer_count_name(config)
    if name is not None and layers_before:
        for key, value in list(vars(config).items()):  # per-layer lists (Gemma3n's sparsity)
            if key != "layer_types" and isinstance(value, (list, tuple)) and \
                    len(value) == layers_before:
                setattr(config, key, value[:getattr(config, name)])
        _shrink_per_layer(config, getattr(config, name))


def _shrink_per_layer(config, layers: int) -> None:
    """A heterogeneous config's per-layer values (transformers 5's ``per_layer_config``: one
    layer's head size or key-value heads other than the rest) shrunk as the global ones, for
    the layers kept."""
    spec = vars(config).get("_heterogeneity_spec")
    overrides = getattr(spec, "per_layer_overrides", None)
    if not isinstance(overrides, dict):
        return
    for index in list(overrides):
        if not isinstance(index, int) or index >= layers:
            del overrides[index]
            continue
        values = overrides[index]
        for key, value in list(values.items()):
            if key == "head_dim" and value:
                values[key] = 8
            elif key == "num_key_value_heads" and value:
                values[key] = min(value, 2)
            elif type(value) is not bool and isinstance(value, (int, float, list)):
                values[key] = _small(key, value, config)


def _layer_count_name(config) -> str | None:
    return next((n for n in ("num_hidden_layers", "num_layers", "n_layer")
                 if isinstance(getattr(config, n, None), int)), None)


def _small(name: str, value, config, stages: bool = True):
    if isinstance(value, float):
        return 0.0 if _DROPOUT.search(name) else value
    if isinstance(value, (list, tuple)):
        # Per-stage lists keep their length (other per-stage lists must match it): each stage
        # gets one block, and heads a power of two (a stage's width is 32 times one).
        if stages and name in ("depths", "depth", "num_layers_per_block") and all(
                type(v) is int for v in value):
            return type(value)([1] * len(value))
        if _DROPOUT.search(name) and all(type(v) is float for v in value):
            return type(value)(0.0 for _ in value)
        if _HEADS.match(name) and all(type(v) is int and v > 0 for v in value):
            return type(value)(min(1 << (v.bit_length() - 1), 4) for v in value)
        return value
    if _LAYERS.match(name):
        return min(value, 2)
    if _HEADS.match(name):
        return min(value, 4)
    if _WIDTHS.match(name):
        return min(value, 32)
    if _FFN.match(name):
        return min(value, 64)
    if name == "vocab_size":
        return min(value, VOCAB)
    if _POSITIONS.match(name):
        return min(value, 64)
    if _TOKEN_IDS.search(name):
        return value % VOCAB
    if name == "image_size":
        return min(value, IMAGE)
    if name == "patch_size":
        return min(value, 8)
    if name in ("num_experts", "num_local_experts", "n_routed_experts"):
        return min(value, 4)
    if name in ("num_experts_per_tok", "top_k", "moe_topk", "num_selected_experts"):
        return min(value, 2)
    if name == "num_kv_shared_layers":  # layers reading another layer's cache (Gemma3n)
        return 0
    if name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rotary_dim"):
        return min(value, 8)  # a head's parts (DeepSeek's latent attention), its rotary part
    if name in ("kv_lora_rank", "q_lora_rank"):
        return min(value, 16)
    return value


def build(model_type: str, seed: int = 0) -> Built:
    """A random-weight model of ``model_type``, shrunk, with its first head (see above)."""
    import transformers
    from transformers.models.auto import modeling_auto
    config = transformers.AutoConfig.for_model(model_type)
    shrink(config)
    unstaged = transformers.AutoConfig.for_model(model_type)
    shrink(unstaged, stages=False)  # for a model that needs more blocks in a stage (CvT)
    for mapping in _HEADS_IN_ORDER:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        cls = getattr(transformers, name, None) if name else None
        if cls is not None:
            break
    else:
        # a part of a composite model (a text or vision tower) that no auto mapping names: the
        # model class its config class is named for (``AltCLIPTextConfig``: ``AltCLIPTextModel``)
        mapping = "MODEL_MAPPING_NAMES"
        cls = _model_class_of(type(config))
        if cls is None:
            raise LookupError(f"no model class for {model_type}")
    for c in (config, unstaged):
        if "SEQ_TO_SEQ" in mapping and getattr(c, "decoder_start_token_id", None) is None:
            c.decoder_start_token_id = getattr(c, "pad_token_id", None) or 0
    torch.manual_seed(seed)
    try:
        model = cls(config).eval()
    except Exception:  # noqa: BLE001 - CvT indexes a stage's blocks by the stage's number
        if unstaged.to_dict() == config.to_dict():
            raise
        config = unstaged
        torch.manual_seed(seed)
        model = cls(config).eval()
    return Built(model_type, model, cls.__name__, _input_maker(model, config, mapping))


def _model_class_of(config_class: type):
    """The model class a config class is named for (``AltCLIPTextConfig``: ``AltCLIPTextModel``),
    exported by transformers or in the modeling module beside the config's; else None."""
    import importlib
    import transformers
    name = config_class.__name__.removesuffix("Config") + "Model"
    found = getattr(transformers, name, None)
    if not isinstance(found, type):
        module = config_class.__module__.replace(".configuration_", ".modeling_")
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:  # (a model whose modeling needs a library not installed here)
            return None
    return found if isinstance(found, type) else None


def float64_ready(model) -> None:
    """A model's float64 copy made runnable: a mixture of experts computes with the plain loop
    over its experts (the same sums as the float32 model's grouped matmul, which has no float64
    kernel)."""
    try:
        model.set_experts_implementation("eager")
    except (AttributeError, ValueError):  # no experts, or no such switch
        pass


def _input_maker(model, config, mapping: str) -> Callable[[int, bool], dict]:
    accepted = set(inspect.signature(model.forward).parameters)
    vocab = getattr(config.get_text_config(), "vocab_size", None) or VOCAB
    channels = getattr(config, "num_channels", 3)
    image = getattr(config, "image_size", IMAGE)
    image = image[0] if isinstance(image, (list, tuple)) else image
    classes = getattr(config, "num_labels", 2)

    def inputs(seed: int, labels: bool) -> dict:
        g = torch.Generator().manual_seed(seed)
        kwargs: dict[str, Any] = {}
        if "input_ids" in accepted:
            kwargs["input_ids"] = torch.randint(2, min(vocab, VOCAB), (BATCH, SEQUENCE),
                                                generator=g)
        if "pixel_values" in accepted:
            kwargs["pixel_values"] = torch.randn(BATCH, channels, image, image, generator=g)
        if "input_values" in accepted and not kwargs:  # raw audio (wav2vec2, HuBERT)
            kwargs["input_values"] = torch.randn(BATCH, AUDIO_SAMPLES, generator=g)
        if "input_features" in accepted and not kwargs:
            kwargs["input_features"] = _audio_features(config, g)
        if "decoder_input_ids" in accepted and not (labels and "labels" in accepted):
            kwargs["decoder_input_ids"] = torch.randint(2, min(vocab, VOCAB),
                                                        (BATCH, SEQUENCE), generator=g)
        if labels and "labels" in accepted:
            if "CLASSIFICATION" in mapping:
                kwargs["labels"] = torch.randint(0, classes, (BATCH,), generator=g)
            elif "input_ids" in kwargs:
                kwargs["labels"] = kwargs["input_ids"].clone()
            else:  # a decoder's targets beside audio or image inputs
                kwargs["labels"] = torch.randint(2, min(vocab, VOCAB), (BATCH, SEQUENCE),
                                                 generator=g)
        if not kwargs:
            raise LookupError("no inputs this sweep knows how to make (audio, video, ...)")
        return kwargs
    return inputs


def _audio_features(config, g: torch.Generator) -> torch.Tensor:
    """Spectrogram features: (batch, mel bins, frames) where the config counts mel bins
    (Whisper: frames twice its source positions), else (batch, frames, features) (Speech2Text)."""
    mels = getattr(config, "num_mel_bins", None)
    if mels:
        frames = 2 * getattr(config, "max_source_positions", SEQUENCE * 4)
        return torch.randn(BATCH, mels, frames, generator=g)
    features = (getattr(config, "input_feat_per_channel", None) or
                getattr(config, "feature_size", None) or 80) * getattr(config, "input_channels", 1)
    return torch.randn(BATCH, SEQUENCE * 4, features, generator=g)


# --------------------------------------------------------------------------------- checking
@dataclass
class Outcome:
    """One system on one model: ``status`` is pass, wrong, refused or internal error."""

    status: str
    detail: str = ""
    route: str = ""
    seconds: float = 0.0
    worst: dict = field(default_factory=dict)  # the value farthest from float64, as a ratio


def _tensors(out) -> list[torch.Tensor]:
    """The floating-point tensors of a model output, in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _loss(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return sum(t.double().square().mean() for t in _tensors(out)[:1])


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).square().mean().sqrt().item()


def _judge(got, eager, reference, scale: float) -> tuple[bool, float]:
    """Whether ``got`` is as close to ``reference`` as allowed, and its error over the allowed;
    ``scale`` is the largest magnitude among the values judged together (a step's gradients):
    a gradient that is zero in exact arithmetic (a key bias before a softmax) is rounding
    noise in float32, judged against the step's scale, not its own."""
    if got is None or reference is None:
        return (got is None) == (reference is None), 0.0
    if got.shape != reference.shape:
        return False, math.inf
    error, allowed = _rmse(got, reference), TOLERANCE * _rmse(eager, reference) + FLOOR * scale
    if not math.isfinite(allowed) or allowed == 0:
        return error == 0 or not math.isfinite(allowed), 0.0
    return error <= allowed, error / allowed


def _scale(tensors) -> float:
    return max((t.double().abs().max().item() for t in tensors
                if t is not None and t.numel()), default=0.0) or 1.0


@dataclass
class _Run:
    """What one system (or eager, in float32 or float64) computed on the model."""

    forward: list
    grads: list  # per step: {name: grad}


def run(model: torch.nn.Module, call: Callable, inputs: Callable, dtype=torch.float32) -> _Run:
    """Eval forward on two inputs, then two SGD training steps; what each produced."""
    torch.manual_seed(0)  # what draws random numbers draws the same in every run
    cast = (lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v)
    forward = []
    model.eval()
    with torch.no_grad():
        for seed in (1, 2):
            out = call(**{k: cast(v) for k, v in inputs(seed, False).items()})
            forward.append([t.detach() for t in _tensors(out)])
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    grads = []
    for seed in (3, 4):
        optimizer.zero_grad(set_to_none=True)
        _loss(call(**{k: cast(v) for k, v in inputs(seed, True).items()})).backward()
        grads.append({n: None if p.grad is None else p.grad.detach().clone()
                      for n, p in model.named_parameters()})
        optimizer.step()
    return _Run(forward, grads)


def compare(got: _Run, eager: _Run, reference: _Run) -> tuple[bool, dict]:
    """Whether every forward output and gradient of ``got`` is as close to float64 as allowed,
    and the worst value (its name, and its error over what is allowed)."""
    worst = {"value": "", "ratio": 0.0}
    ok = True
    values = [(f"forward {i} output {j}", g, e, r, _scale([r]))
              for i, (gs, es, rs) in enumerate(zip(got.forward, eager.forward, reference.forward))
              for j, (g, e, r) in enumerate(zip(gs, es, rs))]
    for i, (gs, es, rs) in enumerate(zip(got.grads, eager.grads, reference.grads)):
        scale = _scale(rs.values())
        values += [(f"step {i} grad {n}", gs[n], es[n], rs[n], scale) for n in rs]
    chaotic = 0
    for name, g, e, r, scale in values:
        if _beyond_float32(e, r):
            chaotic += 1
            continue
        passed, ratio = _judge(g, e, r, scale)
        ok &= passed
        if ratio > worst["ratio"]:
            worst = {"value": name, "ratio": round(ratio, 3)}
    if chaotic:
        worst["not judged"] = chaotic
    return ok, worst


def _beyond_float32(eager, reference) -> bool:
    """Whether eager float32's own error exceeds the value itself (its root mean square): the
    value depends on rounding more than on the model, as a BatchNorm over two values per
    channel after a step makes it (inception's last blocks, batch 2 at 1x1: eager's error on
    its stem's gradients was 23x their size). No float32 program can be judged there, and no
    system is: such values are counted, not compared."""
    if eager is None or reference is None or eager.shape != reference.shape or \
            not reference.numel():
        return False
    size = reference.double().square().mean().sqrt().item()
    return _rmse(eager, reference) > size > 0


SYSTEMS: dict[str, Callable[[torch.nn.Module], Callable]] = {
    "keraunos": lambda m: __import__("keraunos").jit(m),
    # Every call after the first compile on the fused program (Inductor's regions).
    "keraunos fused": lambda m: __import__("keraunos").jit(m, fuse="wait"),
    "torch.compile": lambda m: torch.compile(m),
    "keraunos backend": lambda m: torch.compile(m, backend="keraunos"),
}


def check(built: Built, system: str, eager: _Run, reference: _Run) -> Outcome:
    """``system`` on a copy of ``built.model``, against eager float32 and float64 runs."""
    importlib.import_module("keraunos")  # torch.compile's "keraunos" backend
    from keraunos.errors import KeraunosError
    model = copy.deepcopy(built.model)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = SYSTEMS[system](model)
            got = run(model, compiled, built.inputs)
        except KeraunosError as e:
            internal = "internal error" in str(e)
            return Outcome("internal error" if internal else "refused",
                           _first_line(e), seconds=time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - any other error is the system's failure
            return Outcome("internal error", f"{type(e).__name__}: {_first_line(e)}",
                           seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    route = ""
    if system in ("keraunos", "keraunos fused"):
        fell_back = [str(w.message) for w in caught if "falls back" in str(w.message)]
        where = fell_back[0].split(" because of ")[-1].splitlines()[0] if fell_back else ""
        route = f"fallback: {where[-160:]}" if fell_back else "own capture"
    elif system == "keraunos backend":  # Dynamo's graphs, each compiled by keraunos or run as is
        eager_graphs = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
        route = f"{len(eager_graphs)} graphs uncompiled: " \
            f"{eager_graphs[0].split('could not compile it ')[-1][:120]}" if eager_graphs \
            else "every graph compiled"
    ok, worst = compare(got, eager, reference)
    return Outcome("pass" if ok else "wrong", "", route, seconds, worst)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]


# ------------------------------------------------------------------------------------- timm
# Names that mark a family's small members, preferred when picking one or two of a family.
_SMALL = ("atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "s0", "_t", "mini")


def timm_models(per_family: int = 1) -> list[str]:
    """``per_family`` models of each of timm's model modules (its families), small ones first."""
    import timm
    picked = []
    for family in sorted(timm.list_modules()):
        names = sorted(timm.list_models(module=family),
                       key=lambda n: (not any(s in n for s in _SMALL), len(n), n))
        picked += [f"timm:{n}" for n in names[:per_family]]
    return picked


def build_timm(name: str, seed: int = 0) -> Built:
    """A random-weight timm model with 10 classes, on the smallest image size it runs eager on:
    64 px (given as its ``img_size`` where it takes one), 96, 128, else its own input size (an
    attention bias laid out for 7x7 patches, inception's stem, a window size)."""
    import timm
    for side in (64, 96, 128, None):
        torch.manual_seed(seed)
        try:
            model = timm.create_model(name, pretrained=False, num_classes=10,
                                      **({"img_size": side} if side else {}))
        except TypeError:  # a model without an image size of its own (a CNN), or a fixed one
            model = timm.create_model(name, pretrained=False, num_classes=10)
            if model.pretrained_cfg.get("fixed_input_size"):
                side = None
        own = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
        size = own if side is None else (own[0], side, side)
        # (tried on a copy: a forward may fill the model's caches, which capture must meet empty)
        if side is None or _runs_on(copy.deepcopy(model), size):
            break

    def inputs(seed: int, labels: bool) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(BATCH, *size, generator=g)}
    return Built(f"timm:{name}", _without_dropout(model).eval(), type(model).__name__, inputs)


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its dropout and stochastic depth off (timm's defaults drop whole residual
    branches in training: nest_tiny's last block with probability 0.36), so that a training step
    computes one function, which float64 and every system can be compared on."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        elif isinstance(getattr(module, "drop_prob", None), float):  # DropPath, DropBlock
            module.drop_prob = 0.0
    return model


def _runs_on(model, size: tuple) -> bool:
    """Whether ``model`` runs an eval forward on a batch of images of ``size`` in eager."""
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(BATCH, *size))
        return True
    except Exception:  # noqa: BLE001 - any failure: the size does not fit the model
        return False
