"""`hf_paged.cpu_weights`: linear weights packed for oneDNN give the unpacked model's logits and greedy tokens."""

import copy

import pytest
import torch

import hf_paged
from hf_paged import cpu_weights
from hf_paged.cpu_weights import is_packed, pack_linear_weights, packed_linear_weights, unpack_linear_weights
from test_generate_many import NEW, generate_each, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def llama():
    return make_pair("llama")


def linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


class CountingOneDNN:
    """Stands in for oneDNN's linear in `hf_paged.cpu_weights`, counting calls."""

    def __init__(self, monkeypatch):
        self.calls, self.real = 0, cpu_weights.onednn_linear
        monkeypatch.setattr(cpu_weights, "onednn_linear", self)

    def __call__(self, *args):
        self.calls += 1
        return self.real(*args)


def test_packed_logits_match_unpacked_within_float_tolerance(llama, monkeypatch):
    ref, paged = llama
    ids = torch.randint(3, 96, (3, 11), generator=torch.Generator().manual_seed(0))
    want = logits(ref, ids)
    names = pack_linear_weights(ref)
    assert len(names) == len(linears(ref)) and all(is_packed(m) for m in linears(ref))
    onednn = CountingOneDNN(monkeypatch)
    torch.testing.assert_close(logits(ref, ids), want, rtol=1e-4, atol=1e-4)
    assert onednn.calls == len(linears(ref))  # every linear ran on its packed weight


def test_single_rows_keep_the_plain_matrix_vector_product(llama, monkeypatch):
    ref, _ = llama
    ids = torch.tensor([[5]])
    want = logits(ref, ids)
    pack_linear_weights(ref)
    onednn = CountingOneDNN(monkeypatch)
    assert torch.equal(logits(ref, ids), want) and onednn.calls == 0


def test_greedy_generate_many_packed_equals_per_prompt_generate_packed_and_unpacked(llama):
    ref, paged = llama
    prompts = random_prompts()
    unpacked = generate_each(ref, prompts, NEW, eos_token_id=None)
    pack_linear_weights(ref)
    assert generate_each(ref, prompts, NEW, eos_token_id=None) == unpacked
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=list(NEW), eos_token_id=[], pack_weights=True,
                                 progress=False)
    assert got == unpacked
    assert not any(is_packed(m) for m in linears(paged))  # the call's packing is undone when it ends


def test_unpack_restores_the_model(llama):
    ref, _ = llama
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = logits(ref, ids)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    pack_linear_weights(ref)
    assert sorted(unpack_linear_weights(ref)) == sorted(n for n, m in ref.named_modules()
                                                        if isinstance(m, torch.nn.Linear))
    assert all("forward" not in m.__dict__ and not is_packed(m) for m in linears(ref))
    assert torch.equal(logits(ref, ids), want)
    assert all(torch.equal(v, state[k]) for k, v in ref.state_dict().items())


def test_context_manager_unpacks_only_what_it_packed(llama):
    ref, _ = llama
    first = ref.lm_head
    pack_linear_weights(ref.lm_head)
    with packed_linear_weights(ref) as names:
        assert "lm_head" not in names and all(is_packed(m) for m in linears(ref))
    assert is_packed(first) and sum(is_packed(m) for m in linears(ref)) == 1


def test_a_weight_changed_after_packing_is_repacked_not_read_stale(llama):
    ref, _ = llama
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    pack_linear_weights(ref)
    with torch.no_grad():
        ref.model.layers[0].mlp.down_proj.weight.mul_(-2.0)
    packed_logits = logits(ref, ids)
    unpack_linear_weights(ref)
    torch.testing.assert_close(packed_logits, logits(ref, ids), rtol=1e-4, atol=1e-4)


def test_autograd_still_flows_through_the_plain_weights(llama):
    ref, _ = llama
    pack_linear_weights(ref)
    ref.model.embed_tokens.weight.grad = None
    ref(input_ids=torch.tensor([[4, 5, 6]]), use_cache=False).logits.sum().backward()
    assert ref.lm_head.weight.grad is not None and ref.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_other_dtypes_and_devices_are_refused_clearly_and_left_alone(llama):
    ref, _ = llama
    half = copy.deepcopy(ref).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"float32 nn.Linear weights on the CPU; this model has torch.bfloat16 on cpu"):
        pack_linear_weights(half)
    assert not any(is_packed(m) or "forward" in m.__dict__ for m in linears(half))
    with torch.device("meta"):
        on_meta = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="meta"):
        pack_linear_weights(on_meta)
    with pytest.raises(ValueError, match="batch_hint"):
        pack_linear_weights(ref, batch_hint=0)


def test_modules_whose_forward_is_already_replaced_are_left_alone(llama):
    ref, _ = llama
    hooked = ref.lm_head
    own = hooked.forward
    hooked.forward = lambda x: own(x)  # as accelerate's hooks do
    names = pack_linear_weights(ref)
    assert "lm_head" not in names and not is_packed(hooked)
