"""Helpers shared by the generation tests: prompts, plain greedy and the oracle drafter, a stopping
criterion and a streamer, the sampling oracle (exact marginals, chi-square), left-padded batches, and the
adaptive block size's fakes and probes."""

import random

import torch
from scipy.stats import chisquare
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from tests.conftest import COMMON, VOCAB, OracleDrafter, make_drafter

# --- greedy ---


def prompt(seed: int, length: int = 7) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, length), generator=generator)


def plain_greedy(target, input_ids, **kwargs):
    return target.generate(input_ids, do_sample=False, **kwargs)


def oracle_for(target, input_ids, block_size, max_new_tokens):
    greedy = plain_greedy(target, input_ids, max_new_tokens=max_new_tokens + block_size, eos_token_id=None)
    config = make_drafter(target, block_size=block_size).config
    return OracleDrafter(config, target.get_output_embeddings().weight, greedy).eval()


class StopAfterToken(StoppingCriteria):
    """Custom criterion: stop once `token` was generated (a stand-in for any user criterion)."""

    def __init__(self, token: int, prompt_length: int):
        self.token, self.prompt_length = token, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_length :] == self.token).any(-1)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


# --- sampling ---


ALPHA = 1e-3  # a correct sampler fails one run in a thousand


@torch.no_grad()
def exact_next_token_probs(target, input_ids, **warpers) -> torch.Tensor:
    """softmax of the processed target logits for the next token, as `generate` computes them."""
    config = target.generation_config
    processors = target._get_logits_processor(
        generation_config=type(config)(do_sample=True, **warpers),
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=None,
    )
    logits = target(input_ids).logits[:, -1].float()
    return processors(input_ids, logits).softmax(-1)[0]


@torch.no_grad()
def second_token_marginal(target, prefix: torch.LongTensor, **warpers) -> torch.Tensor:
    """Exact distribution of the 2nd new token: sum_t1 p(t1 | prefix) p(t2 | prefix, t1)."""
    p_first = exact_next_token_probs(target, prefix, **warpers)
    firsts = p_first.nonzero()[:, 0]
    extended = torch.cat([prefix.expand(len(firsts), -1), firsts[:, None]], -1)
    return p_first[firsts] @ torch.stack([exact_next_token_probs(target, row[None], **warpers) for row in extended])


def chi_square_against(counts: torch.Tensor, probs: torch.Tensor, label: str):
    """Chi-square of observed token counts against exact probabilities; low-probability bins are merged
    so every expected count is >= 5. Asserts no token outside the support was drawn."""
    support = probs > 0
    assert counts[~support].sum() == 0  # never a token the warpers removed
    expected = probs[support] * counts.sum()
    order = expected.argsort()
    observed, expected = counts[support][order], expected[order]
    small = expected.cumsum(0) < 5
    observed = torch.cat([observed[small].sum(0, keepdim=True), observed[~small]])
    expected = torch.cat([expected[small].sum(0, keepdim=True), expected[~small]])
    result = chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy())
    print(f"{label}: chi2={result.statistic:.2f} over {len(observed)} bins, p={result.pvalue:.3f}")
    return result


@torch.no_grad()
def check_sampled_second_token(target, drafter, label: str, draws: int = 1200, **generate_kwargs) -> None:
    """End to end through `generate`: the 2nd new token (drafted, then verified by rejection sampling)
    follows its exact marginal sum_t1 p(t1) p(t2 | t1) under the target with the same warpers, and
    drafts really were accepted (acceptance is exercised, not only rejection)."""
    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    prefix = torch.tensor([[5, 17, 33, 9, 71]])
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    rounds = []
    for _ in range(draws):
        out = target.generate(
            prefix, do_sample=True, max_new_tokens=3, assistant_model=drafter, eos_token_id=None, **warpers,
            **generate_kwargs,
        )  # fmt: skip
        counts[out[0, prefix.shape[1] + 1]] += 1
        rounds += drafter.last_acceptance.acceptance_lengths
    assert chi_square_against(counts, p_second, label).pvalue > ALPHA
    assert max(rounds) >= 2


# --- batched ---


PAD = COMMON["pad_token_id"]


def random_batch(generator: torch.Generator, batch_size: int, shortest: int = 2, longest: int = 12):
    """Left-padded (input_ids, attention_mask) of `batch_size` random prompts of ragged lengths."""
    lengths = torch.randint(shortest, longest + 1, (batch_size,), generator=generator).tolist()
    width = max(lengths)
    input_ids = torch.full((batch_size, width), PAD)
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, VOCAB, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def unpadded(input_ids, attention_mask, row: int) -> torch.LongTensor:
    return input_ids[row, attention_mask[row].bool()][None]


def eos_mid_way(target, input_ids, attention_mask, max_new_tokens, generator) -> int:
    """A token that one row emits mid-way without EOS: as EOS, rows then stop at different times."""
    free = target.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    row = int(torch.randint(len(input_ids), (1,), generator=generator))
    step = int(torch.randint(max_new_tokens // 2 + 1, (1,), generator=generator))
    return int(free[row, input_ids.shape[1] + step])


# --- adaptive block size ---


LINEAR_COST = lambda k: 1.0 + 0.1 * (k - 1)  # noqa: E731  (synthetic seconds per round)


class FakeMeasure:
    """Injected instead of timing: seconds = rows * (1 + 0.1 k); counts the rows it was asked for."""

    def __init__(self):
        self.calls = []

    def __call__(self, target, drafter, rows, block_lengths):
        self.calls.append(rows)
        return [rows * LINEAR_COST(k) for k in block_lengths]


def random_schedule(max_block_size: int, seed: int):
    rng = random.Random(seed)
    return lambda round_index: rng.randint(1, max_block_size)


def record_drafter_calls(drafter) -> tuple[list[dict], object]:
    """(calls, hook handle): the keyword arguments of every drafter forward, with the cache length before it."""
    calls = []

    def hook(module, args, kwargs):
        calls.append(dict(kwargs, past=kwargs["cache"].get_seq_length()))

    return calls, drafter.register_forward_pre_hook(hook, with_kwargs=True)


def reference_features(target, drafter, sequence: torch.LongTensor) -> torch.Tensor:
    """(L, n*Ht) target features of an unpadded sequence (L,) from one plain forward."""
    layer_ids = drafter.config.target_layer_ids
    hidden = target(sequence[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0] for i in layer_ids], -1)
