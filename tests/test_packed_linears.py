"""Linear layers through oneDNN with prepacked weights: same products, layers restored, DFlash still lossless."""

import pytest
import torch
from torch import nn

import hf_dflash.packed_linears as packed_linears_module
from hf_dflash.generation.linear_packing import linear_packing_setting, loop_linear_packing
from hf_dflash.generation.policies.cost_timing import cost_model_key
from hf_dflash.packed_linears import (
    PACK_ATTRIBUTE,
    is_packed,
    linear_packing_supported,
    packable_dtypes,
    packed_linears,
    packing_pays,
    release_packed_weights,
)
from tests.conftest import make_drafter, make_target
from tests.helpers.generation import plain_greedy, prompt

pytestmark = pytest.mark.skipif(not linear_packing_supported(), reason="this torch build has no MKL-DNN")
# bf16 packs only where oneDNN multiplies bf16 on this CPU (not on an AVX2-only one; the test below covers that case)
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN has no bf16 path on this CPU"),
)


@pytest.fixture
def no_onednn_bf16(monkeypatch):
    """This process as on a CPU where oneDNN has no bf16 path (an AVX2-only AMD EPYC, where torch 2.13 refuses to
    reorder a bf16 weight)."""
    monkeypatch.setattr(packed_linears_module, "onednn_bf16_supported", lambda: False)
    packable_dtypes.cache_clear()
    yield
    packable_dtypes.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (8, 48), (2, 5, 48)])
def test_packed_product_equals_the_default_one(dtype, bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(48, 40, bias=bias).to(dtype)
    hidden = torch.randn(shape, dtype=dtype)
    with torch.no_grad():
        expected = layer(hidden)
        with packed_linears(layer, rows=8) as count:
            assert count == 1 and "forward" in vars(layer)
            actual = layer(hidden)
    assert actual.shape == expected.shape and actual.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
    assert "forward" not in vars(layer)  # restored: the class's own forward again


def test_state_dict_untouched_and_pack_kept_until_released():
    model = make_target("llama")
    keys = list(model.state_dict())
    with torch.no_grad(), packed_linears(model):
        model(prompt(0))
        assert is_packed(model)
        assert list(model.state_dict()) == keys
    assert not is_packed(model)
    layers = [layer for layer in model.modules() if isinstance(layer, nn.Linear)]
    assert all(PACK_ATTRIBUTE in vars(layer) for layer in layers)  # reused by the next call
    release_packed_weights(model)
    assert not any(PACK_ATTRIBUTE in vars(layer) for layer in layers)


def test_weight_changed_in_place_is_packed_again():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    hidden = torch.randn(3, 16)
    with torch.no_grad(), packed_linears(layer):
        layer(hidden)
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(hidden), nn.functional.linear(hidden, layer.weight, layer.bias))
        layer.weight = nn.Parameter(torch.randn(8, 16))
        torch.testing.assert_close(layer(hidden), nn.functional.linear(hidden, layer.weight, layer.bias))


def test_autograd_runs_the_default_path():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    hidden = torch.randn(3, 16, requires_grad=True)
    with packed_linears(layer):
        layer(hidden).sum().backward()
    assert hidden.grad is not None and layer.weight.grad is not None


def test_only_plain_cpu_linears_in_packable_dtypes_are_packed():
    class Custom(nn.Linear):
        pass

    modules = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4).half(), Custom(4, 4), nn.Linear(4, 4).double()])
    with packed_linears(modules) as count:
        assert count == 1 and "forward" in vars(modules[0])
        assert not any("forward" in vars(layer) for layer in modules[1:])


@pytest.mark.parametrize("rows", [0, -1, 2.0, True, "8"])
def test_bad_rows_are_refused(rows):
    with pytest.raises(ValueError, match="positive int"):
        with packed_linears(nn.Linear(4, 4), rows=rows):
            pass


def test_packing_pays_is_a_measured_verdict():
    model = make_target("llama")
    assert packing_pays(model, rows=8) in (True, False)
    assert packing_pays(nn.Module()) is False  # nothing to pack


@pytest.mark.parametrize("setting", ["yes", 1, None, "AUTO"])
def test_bad_setting_is_refused_by_name(setting):
    drafter = make_drafter(make_target("llama"))
    drafter.linear_packing = setting
    with pytest.raises(ValueError, match="drafter.linear_packing"):
        linear_packing_setting(drafter)


def test_cost_model_key_says_whether_the_target_was_packed():
    target = make_target("llama")
    drafter = make_drafter(target)
    unpacked = cost_model_key(target, drafter)
    with packed_linears(target):
        packed = cost_model_key(target, drafter)
    assert unpacked["linear_packing"] is False and packed["linear_packing"] is True


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", [True, False])
def test_dflash_with_packed_layers_matches_plain_greedy(arch, setting):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=4)
    drafter.linear_packing = setting
    for seed in range(3):
        input_ids = prompt(seed, length=5 + seed)
        expected = plain_greedy(target, input_ids, max_new_tokens=30)
        actual = target.generate(input_ids, do_sample=False, max_new_tokens=30, assistant_model=drafter)
        assert torch.equal(actual, expected)
    assert not is_packed(target) and not is_packed(drafter)


@pytest.mark.parametrize("setting", [True, "auto"])
def test_bf16_layers_stay_unpacked_where_onednn_has_no_bf16_path(no_onednn_bf16, setting):
    """On such a CPU a bf16 DFlash call runs the default matmul (it crashed in the weight reorder before) and
    matches plain greedy; float32 layers are still packed."""
    assert packable_dtypes() == (torch.float32,)
    target = make_target("llama").to(torch.bfloat16)
    drafter = make_drafter(target, block_size=4).to(torch.bfloat16)
    with torch.no_grad(), packed_linears(target, drafter) as count, packed_linears(nn.Linear(8, 4)) as fp32_count:
        assert count == 0 and fp32_count == 1 and not is_packed(target)
    drafter.linear_packing = setting
    input_ids = prompt(0, length=6)
    expected = plain_greedy(target, input_ids, max_new_tokens=16)
    actual = target.generate(input_ids, do_sample=False, max_new_tokens=16, assistant_model=drafter)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("mode", ["tree", "hybrid", "batch"])
def test_every_mode_with_packed_layers_matches_plain_greedy(mode):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.linear_packing = True
    drafter.draft_tree = 6 if mode == "tree" else None
    lookup = dict(prompt_lookup_num_tokens=3) if mode == "hybrid" else {}
    if mode == "batch":
        input_ids = torch.cat([prompt(1, length=6), prompt(2, length=6)])
        expected = torch.cat([plain_greedy(target, input_ids[i : i + 1], max_new_tokens=24) for i in range(2)])
    else:
        input_ids = torch.cat([prompt(3, length=5)] * 2, 1)  # a repeat: n-gram drafts find something
        expected = plain_greedy(target, input_ids, max_new_tokens=24)
    actual = target.generate(input_ids, do_sample=False, max_new_tokens=24, assistant_model=drafter, **lookup)
    assert torch.equal(actual, expected)


def graph_ops(captured: list):
    """A torch.compile backend that records the ops of every graph it is given and runs it as traced."""

    def backend(graph_module, example_inputs):
        captured.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    return backend


def test_a_compiled_forward_runs_the_packed_products_in_one_graph():
    """Inductor lowers oneDNN's linear only over weights it froze itself: the packed layers reach a compiled graph
    as one opaque op each (no graph break), and the compiled forward computes what the eager one does."""
    target = make_target("llama")
    input_ids = prompt(5, length=6)
    with torch.no_grad():
        expected = target(input_ids).logits
        captured: list[str] = []
        with packed_linears(target) as count:
            torch._dynamo.reset()
            traced = torch.compile(target.forward, backend=graph_ops(captured), fullgraph=True)(input_ids).logits
        torch._dynamo.reset()
    assert count > 0 and captured.count("hf_dflash.packed_linear.default") == count
    assert "aten.linear.default" not in captured and "<built-in function linear>" not in captured
    torch.testing.assert_close(traced, expected, rtol=1e-4, atol=1e-5)  # inductor's own run: the next test


def test_compiled_dflash_with_packed_layers_matches_plain_greedy():
    """Compiled verification (static cache + compile_config, inductor) runs packed, and stays lossless."""
    from tests.helpers.compiled import compiled_dflash

    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.linear_packing = True
    input_ids = prompt(6, length=7)
    expected = plain_greedy(target, input_ids, max_new_tokens=20, eos_token_id=None)
    packed_during_rounds = []
    forward = target.forward

    def spy(*args, **kwargs):
        packed_during_rounds.append(is_packed(target))
        return forward(*args, **kwargs)

    target.forward = spy
    torch._dynamo.reset()
    try:
        assert torch.equal(compiled_dflash(target, drafter, input_ids, 20), expected)
    finally:
        torch._dynamo.reset()
    assert packed_during_rounds and all(packed_during_rounds)


def fake_stack(monkeypatch, model, dtype, seconds):
    """Replace the timed stack by `seconds(rows, pack_rows)` (packs still made, as the real one makes them)."""
    monkeypatch.setattr(packed_linears_module, "_PAYS", {})

    def stack_seconds(layers, hiddens, pack_rows):
        assert len(layers) == len(packed_linears_module.packable_layers(model))
        rows = {hidden.shape[0] for hidden in hiddens.values()}
        assert all(hidden.dtype == dtype for hidden in hiddens.values()) and len(rows) == 1
        if pack_rows is not None:
            for layer in layers:
                packed_linears_module.packed_weight(layer, pack_rows)
        return seconds(rows.pop(), pack_rows)

    monkeypatch.setattr(packed_linears_module, "stack_seconds", stack_seconds)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("default_ms, packed_ms, pays", [(10.0, 9.0, True), (10.0, 9.5, False), (9.0, 10.0, False)])
def test_packing_pays_by_the_streamed_stack(monkeypatch, dtype, default_ms, packed_ms, pays):
    """The verdict is the timed stack of every layer (both dtypes alike), with a 1.1x margin; packs made for the
    timing are freed when packing does not pay, kept when it does."""
    model = make_target("llama").to(dtype)
    fake_stack(monkeypatch, model, dtype, lambda rows, pack_rows: (packed_ms if pack_rows else default_ms) / 1000)
    assert packing_pays(model, rows=8) is pays
    kept = [PACK_ATTRIBUTE in vars(layer) for layer in packed_linears_module.packable_layers(model)]
    assert all(kept) if pays else not any(kept)


@pytest.mark.parametrize("pays_from, floor", [(1, 1), (2, 4), (4, 4), (5, 8), (8, 8), (9, None)])
def test_packing_floor_is_the_fewest_rows_timed_faster(monkeypatch, pays_from, floor):
    """Timed at 8 rows, then 1 and 4: the floor is the first probe where packing pays (8 when only there)."""
    model = make_target("llama")
    fake_stack(monkeypatch, model, torch.float32, lambda rows, pack_rows: 0.5 if pack_rows and rows >= pays_from else 1)
    assert packed_linears_module.packing_floor(model, rows=8) == floor


def test_products_below_the_floor_take_the_default_path(monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    packed_calls = []
    real = packed_linears_module.packed_weight
    monkeypatch.setattr(packed_linears_module, "packed_weight", lambda *args: packed_calls.append(1) or real(*args))
    with torch.no_grad(), packed_linears(layer, from_rows=4):
        for shape, packed in (
            ((1, 16), False),
            ((3, 16), False),
            ((1, 3, 16), False),
            ((4, 16), True),
            ((2, 2, 16), True),
        ):
            packed_calls.clear()
            hidden = torch.randn(shape)
            torch.testing.assert_close(layer(hidden), nn.functional.linear(hidden, layer.weight, layer.bias))
            assert bool(packed_calls) is packed, shape


def test_stack_seconds_runs_every_layer_both_ways():
    model = make_target("llama")
    layers = packed_linears_module.packable_layers(model)
    hiddens = {size: torch.randn(3, size) for size in {layer.in_features for layer in layers}}
    assert packed_linears_module.stack_seconds(layers, hiddens, None) > 0
    assert not any(PACK_ATTRIBUTE in vars(layer) for layer in layers)
    assert packed_linears_module.stack_seconds(layers, hiddens, 8) > 0
    assert all(PACK_ATTRIBUTE in vars(layer) for layer in layers)


def test_the_draft_vocabulary_head_is_packed_and_still_lossless():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4, draft_vocab_size=64)
    drafter.linear_packing = True
    head = drafter.draft_head(target.get_output_embeddings())
    assert head is drafter.draft_head(target.get_output_embeddings())  # gathered once
    assert not any(name.startswith("_draft") for name, _ in drafter.named_modules())  # never saved
    with loop_linear_packing(target, drafter):
        assert "forward" in vars(head)
    input_ids = prompt(4, length=6)
    expected = plain_greedy(target, input_ids, max_new_tokens=20)
    assert torch.equal(
        target.generate(input_ids, do_sample=False, max_new_tokens=20, assistant_model=drafter), expected
    )
