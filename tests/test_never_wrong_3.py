"""Never wrong, never an internal error, round 3 (issue 26, items 5, 6 and 9).

Every test compares with eager PyTorch: outputs, in-place effects, gradients.
"""
from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from helpers import check_grads
import keraunos

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no network


# ------------------------------------------------- 5. objects copied or pickled during capture
class Inner:
    def __init__(self):
        self.shift = 0.5


class Options:
    def __init__(self):
        self.scale = 2.0
        self.inner = Inner()


class ReadsThrough(nn.Module):
    """Reads its options through ``how(self.opts)``: a copy, a pickle round trip, ``vars``."""

    def __init__(self, how):
        super().__init__()
        self.opts = Options()
        self.how = how

    def forward(self, x):
        opts = self.how(self.opts)
        return x * opts.scale + opts.inner.shift


def unpickled(obj):
    return pickle.loads(pickle.dumps(obj))


class AsDict:
    """What ``vars`` gives, read as attributes."""

    def __init__(self, obj):
        self.__dict__.update(vars(obj))


COPIES = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": unpickled, "vars": AsDict}


@pytest.mark.parametrize("how", COPIES)
def test_copied_options_read_like_the_originals_and_stay_guarded(how):
    m = ReadsThrough(COPIES[how])
    jitted = keraunos.jit(m)
    x = torch.randn(3)
    assert_close(jitted(x), m(x))
    assert_close(jitted(x), m(x))
    assert keraunos.cache_hits(jitted) == 1
    # What the program read through the copy is guarded on the original.
    m.opts.scale = 3.0
    assert_close(jitted(x), m(x))
    m.opts.inner.shift = -1.0
    assert_close(jitted(x), m(x))


def test_a_copy_made_during_capture_is_of_the_real_class():
    class Checks(nn.Module):
        def __init__(self):
            super().__init__()
            self.opts = Options()

        def forward(self, x):
            mine = copy.deepcopy(self.opts)
            # Runs during capture: the copy must not wear the recording stand-in class.
            assert type(mine) is Options and type(mine.inner) is Inner
            assert unpickled(mine).inner.shift == 0.5
            mine.scale = 5.0  # the program's own write, to its own copy
            return x * mine.scale

    m = Checks()
    x = torch.randn(3)
    assert_close(keraunos.jit(m)(x), m(x))
    assert type(m.opts) is Options and m.opts.scale == 2.0


class CopiesItself:
    """A class whose own ``__copy__`` builds a new instance with ``type(self)``."""

    def __init__(self, scale=2.0):
        self.scale = scale

    def __copy__(self):
        return type(self)(self.scale)


def test_a_class_copying_itself_with_type_self_is_read_and_guarded():
    class Uses(nn.Module):
        def __init__(self):
            super().__init__()
            self.opts = CopiesItself()

        def forward(self, x):
            mine = copy.copy(self.opts)
            mine.scale = mine.scale + 1  # written and read on the program's own object
            return x * mine.scale

    m = Uses()
    jitted = keraunos.jit(m)
    x = torch.randn(3)
    assert_close(jitted(x), m(x))
    m.opts.scale = 4.0
    assert_close(jitted(x), m(x))


class Settings:
    def __init__(self, scale):
        self.scale = scale


def test_copying_an_object_passed_in_reads_what_the_call_passes():
    def fn(x, settings):
        return x * copy.copy(settings).scale

    jitted = keraunos.jit(fn)
    x = torch.randn(3)
    assert_close(jitted(x, Settings(2.0)), fn(x, Settings(2.0)))
    assert_close(jitted(x, Settings(3.0)), fn(x, Settings(3.0)))


def test_copying_an_object_passed_in_that_the_program_wrote_is_refused():
    def fn(x, settings):
        settings.scale = 4.0
        return x * copy.copy(settings).scale

    with pytest.raises(keraunos.CaptureError, match="copies or pickles"):
        keraunos.jit(fn)(torch.randn(3), Settings(2.0))


# --- 5, on transformers models whose forward copies its config (tiny, random weights) --------
def _tiny_seq2seq(kind):
    import transformers as tf
    torch.manual_seed(0)
    if kind == "whisper":
        config = tf.WhisperConfig(
            vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
            pad_token_id=0, decoder_start_token_id=1)
        return tf.WhisperForConditionalGeneration(config)
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            decoder_start_token_id=0))
    return tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32))


def _seq2seq_inputs(kind):
    g = torch.Generator().manual_seed(1)
    decoder_ids = torch.randint(2, 64, (2, 5), generator=g)
    if kind == "whisper":  # (batch, mel bins, frames = 2 * max_source_positions)
        return dict(input_features=torch.randn(2, 8, 16, generator=g),
                    decoder_input_ids=decoder_ids)
    return dict(input_ids=torch.randint(2, 64, (2, 6), generator=g), decoder_input_ids=decoder_ids)


def _assert_same_seq2seq_output(got, want):
    from keraunos.testing.zoo import assert_same_output
    assert type(got) is type(want) and list(got.keys()) == list(want.keys())
    for key in want.keys():
        if key in ("past_key_values", "cache"):  # use_cache=True: an EncoderDecoderCache (named
            # "cache" from transformers 5.2x)
            assert type(got[key]) is type(want[key])
            assert_same_output(got[key].self_attention_cache, want[key].self_attention_cache)
            assert_same_output(got[key].cross_attention_cache, want[key].cross_attention_cache)
        else:
            assert_same_output(got[key], want[key], key)


@pytest.mark.parametrize("kind", ["whisper", "t5", "bart"])
def test_seq2seq_forward_that_copies_its_config_matches_eager(kind):
    pytest.importorskip("transformers")
    from keraunos.testing.zoo import eval_and_copy
    model, ref = eval_and_copy(_tiny_seq2seq(kind))
    jitted = keraunos.jit(model)
    kwargs = _seq2seq_inputs(kind)
    with torch.no_grad():
        _assert_same_seq2seq_output(jitted(**kwargs), ref(**kwargs))
        _assert_same_seq2seq_output(jitted(**kwargs), ref(**kwargs))
    assert keraunos.cache_hits(jitted) == 1


def test_t5_training_step_that_copies_its_config_matches_eager():
    pytest.importorskip("transformers")
    from keraunos.testing.zoo import assert_same_grads, eval_and_copy
    model, ref = eval_and_copy(_tiny_seq2seq("t5"))
    model.train()
    ref.train()
    g = torch.Generator().manual_seed(2)
    kwargs = dict(input_ids=torch.randint(2, 64, (2, 6), generator=g),
                  labels=torch.randint(2, 64, (2, 5), generator=g))  # use_cache stays on
    torch.manual_seed(10)  # the same dropout masks
    out = keraunos.jit(model)(**kwargs)
    torch.manual_seed(10)
    want = ref(**kwargs)
    _assert_same_seq2seq_output(out, want)
    out.loss.backward()
    want.loss.backward()
    assert_same_grads(model, ref)


# --------------------------------------------------------------------- 9. review defects
def test_libraries_beside_torch_and_keraunos_are_user_code():
    from keraunos import errors
    site = os.path.dirname(errors._TORCH_DIR)
    for library in ("torchvision", "torchaudio", "torch_geometric"):
        assert not errors.is_internal(os.path.join(site, library, "models", "net.py"))
    assert errors.is_internal(os.path.join(errors._TORCH_DIR, "nn", "functional.py"))
    keraunos_dir = errors._KERAUNOS_DIR
    assert not errors.is_internal(keraunos_dir + "_plugins" + os.sep + "ops.py")
    assert errors.is_internal(os.path.join(keraunos_dir, "runtime/call.py"))


def test_libraries_installed_inside_the_standard_library_directory_are_user_code(monkeypatch):
    from keraunos import errors
    stdlib = os.path.join(os.sep, "opt", "conda", "lib", "python3.11")  # conda's layout
    monkeypatch.setattr(errors, "_STDLIB_DIR", stdlib)
    assert errors.is_internal(os.path.join(stdlib, "contextlib.py"))
    assert errors.is_internal(os.path.join(stdlib, "json", "decoder.py"))
    for site in ("site-packages", "dist-packages"):
        library = os.path.join(stdlib, site, "mylib", "model.py")
        assert not errors.is_internal(library)
        assert errors.is_internal(library, skip_stdlib=False) is False


def _sub_bool_functions():
    return {
        "torch.sub": lambda x: torch.sub(x, True),
        "torch.subtract": lambda x: torch.subtract(x, True),
        "torch.rsub": lambda x: torch.rsub(x, True),
        "aten.sub.Tensor": lambda x: torch.ops.aten.sub.Tensor(x, x > 0),
    }


@pytest.mark.parametrize("name", _sub_bool_functions())
def test_an_unused_subtraction_of_a_bool_raises_eagers_error(name):
    subtract = _sub_bool_functions()[name]

    def fn(x):
        subtract(x)  # unused: dead code elimination would drop it
        return x * 2

    x = torch.randn(3)
    with pytest.raises(RuntimeError) as eager:
        fn(x)
    with pytest.raises(type(eager.value), match="Subtraction, the `-` operator, with a bool"):
        keraunos.jit(fn)(x)


def test_aten_ops_whose_output_depends_on_data_stay_out_of_fusion_regions():
    from keraunos.executors.fusion.regions import fusible

    def fn(x):
        a = torch.ops.aten.nonzero_static.default(x > 0, size=3)
        b = torch.ops.aten.histc.default(x, bins=4)
        return a * 2, b * 2

    jitted = keraunos.jit(fn)
    x = torch.randn(5)
    for got, want in zip(jitted(x), fn(x)):
        assert_close(got, want)
    lines = {getattr(b.symbol, "name", None): b for b in keraunos.last_traces(jitted)[0].bound_symbols}
    assert not fusible(lines["torch.ops.aten.nonzero_static.default"])
    assert not fusible(lines["torch.ops.aten.histc.default"])
    assert fusible(lines["mul"])


class Box:
    """An object passed in whose attributes differ between instances of its class."""


def scale_if_any(x, box):
    if hasattr(box, "scale"):
        return x * box.scale
    return x + 1


def test_a_prologue_that_raises_is_not_this_entry_and_later_calls_stay_fast(monkeypatch):
    from keraunos.runtime import call as jit_module
    jitted = keraunos.jit(scale_if_any)
    x = torch.randn(3)
    scaled, plain = Box(), Box()
    scaled.scale = 2.0
    assert_close(jitted(x, scaled), scale_if_any(x, scaled))
    # The entry compiled for `scaled` reads box.scale, which `plain` lacks: its prologue raises.
    assert_close(jitted(x, plain), scale_if_any(x, plain))
    misses = []
    real_miss = jit_module._miss
    monkeypatch.setattr(jit_module, "_miss", lambda *a: misses.append(a) or real_miss(*a))
    for _ in range(3):
        assert_close(jitted(x, scaled), scale_if_any(x, scaled))
        assert_close(jitted(x, plain), scale_if_any(x, plain))
    assert misses == [] and keraunos.cache_misses(jitted) == 2


def test_when_no_prologue_fits_the_programs_own_error_is_raised():
    def read_scale(x, box):
        return x * box.scale

    jitted = keraunos.jit(read_scale)
    x, box = torch.randn(3), Box()
    box.scale = 2.0
    assert_close(jitted(x, box), read_scale(x, box))
    with pytest.raises(AttributeError, match="scale"):
        jitted(x, Box())
    assert_close(jitted(x, box), read_scale(x, box))


def test_keraunos_jit_backward_of_linear_has_no_transpose_of_a_transpose():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    jitted = check_grads(model, torch.randn(3, 8))
    backward = keraunos.last_backward_traces(jitted)[-1]
    transposes = [b for b in backward.bound_symbols
                  if getattr(b.symbol, "fn", None) is torch.ops.aten.t.default]
    made_by_t = {b.outputs.name for b in transposes}
    assert transposes and not any(b.args[0].name in made_by_t for b in transposes)
    assert any("Peephole" in line for line in backward.header)


# ------------------------------------------------- 6. nn.LSTM, nn.GRU, nn.RNN and their flat weights
def _as_tuple(hidden):
    return hidden if isinstance(hidden, tuple) else (hidden,)


def _rnn_call_matches_eager(jitted, model, ref, x, hx=None, grads=False):
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    hx_ref = None if hx is None else tuple(h.detach().clone() for h in _as_tuple(hx))
    if hx_ref is not None and not isinstance(hx, tuple):
        hx_ref = hx_ref[0]
    out, hidden = jitted(x, hx) if hx is not None else jitted(x)
    want, want_hidden = ref(x_ref, hx_ref) if hx is not None else ref(x_ref)
    assert_close(out, want)
    for got, expected in zip(_as_tuple(hidden), _as_tuple(want_hidden), strict=True):
        assert_close(got, expected)
    if grads:
        (out.sum() + _as_tuple(hidden)[0].pow(2).sum()).backward()
        (want.sum() + _as_tuple(want_hidden)[0].pow(2).sum()).backward()
        assert_close(x.grad, x_ref.grad)
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close(p.grad, p_ref.grad, msg=name)


RNNS = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", RNNS)
def test_recurrent_layers_match_eager_and_follow_their_weights(kind, train):
    torch.manual_seed(0)
    model = RNNS[kind](4, 5, num_layers=2, batch_first=True, bidirectional=True)
    ref = copy.deepcopy(model)
    model.train(train)
    ref.train(train)
    jitted = keraunos.jit(model)

    def call():
        x = torch.randn(2, 3, 4, requires_grad=train)
        _rnn_call_matches_eager(jitted, model, ref, x, grads=train)
    call()
    call()
    assert keraunos.cache_hits(jitted) == 1
    with torch.no_grad():  # the user changes a weight in place
        model.weight_hh_l0.mul_(0.5)
        ref.weight_hh_l0.mul_(0.5)
    call()
    weight = torch.randn_like(model.weight_ih_l1_reverse)  # and reassigns a parameter
    model.weight_ih_l1_reverse = nn.Parameter(weight.clone())
    ref.weight_ih_l1_reverse = nn.Parameter(weight.clone())
    call()
    assert model._flat_weights[model._flat_weights_names.index("weight_ih_l1_reverse")] is \
        model.weight_ih_l1_reverse


@pytest.mark.parametrize("kind", RNNS)
def test_recurrent_layers_with_an_initial_hidden_state_match_eager(kind):
    torch.manual_seed(0)
    model = RNNS[kind](4, 5)
    ref = copy.deepcopy(model)
    jitted = keraunos.jit(model)
    h0 = torch.randn(1, 2, 5)
    hx = (h0, torch.randn(1, 2, 5)) if kind == "LSTM" else h0
    _rnn_call_matches_eager(jitted, model, ref, torch.randn(3, 2, 4, requires_grad=True), hx,
                            grads=True)


def test_a_gru_trains_like_eager_under_fusion():
    torch.manual_seed(0)
    model = nn.GRU(4, 5, batch_first=True)
    ref = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=["inductor", "torch"], fuse="wait")
    for _ in range(2):
        _rnn_call_matches_eager(jitted, model, ref, torch.randn(2, 2, 4, requires_grad=True),
                                grads=True)
    assert keraunos.cache_hits(jitted) == 1
    assert keraunos.last_fusions(jitted)  # the cells' pointwise ops run in fused regions
