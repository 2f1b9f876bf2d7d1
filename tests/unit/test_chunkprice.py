"""The price of prompt chunks beside decoding, fitted as steps run, and the chunk size it allows."""

import pytest

from workers.engine.chunkprice import MAX_CHUNK, MIN_CHUNK, STALL, ChunkCost, Price, chunk_budget


def test_a_fixed_price_and_a_price_per_token_are_told_apart() -> None:
    cost = ChunkCost()
    for tokens in (64, 16, 200, 32, 128, 16, 64):
        cost.add(tokens, tokens * 1000, 0.020 + 0.0001 * tokens)  # every chunk ends near position 1,000
    assert cost.fit() == Price(pytest.approx(0.020, rel=1e-6), pytest.approx(0.0001, rel=1e-6), 0.0)


def test_a_price_per_attended_position_is_told_apart() -> None:
    # chunks of a long prompt: the deeper they start, the more their attention costs per token
    cost = ChunkCost()
    for tokens, start in ((16, 0), (32, 16), (48, 48), (24, 96), (40, 120), (32, 160), (16, 192), (48, 208)):
        end = start + tokens
        cost.add(tokens, tokens * end, 0.010 + 0.0003 * tokens + 2e-6 * tokens * end)
    fitted = cost.fit()
    assert fitted == Price(pytest.approx(0.010, rel=1e-6), pytest.approx(0.0003, rel=1e-6),
                           pytest.approx(2e-6, rel=1e-6))
    # deeper in the prompt, fewer tokens cost the same
    assert chunk_budget(0.100, fitted, start=1500) < chunk_budget(0.100, fitted, start=0)


def test_chunks_of_one_size_are_priced_per_token() -> None:
    cost = ChunkCost()
    assert cost.fit() is None
    for _ in range(3):
        cost.add(16, 16 * 100, 0.008)
    assert cost.fit() == Price(0.0, pytest.approx(0.0005), 0.0)


def test_noise_that_hides_the_slope_leaves_a_price_per_token() -> None:
    # a slow CPU: chunks of 5 to 17 tokens beside decoding, whose cost the machine's noise swamps
    # (bigger chunks measured cheaper); a slope of nothing would let the next chunk be huge
    cost = ChunkCost()
    start = 0
    for tokens, seconds in ((5, 0.150), (9, 0.120), (13, 0.110), (17, 0.100)):
        start += tokens
        cost.add(tokens, tokens * start, seconds)
    fitted = cost.fit()
    assert fitted is not None and fitted.fixed == 0.0 and fitted.per_token > 0.005
    assert chunk_budget(0.170, fitted, start) < 32


def test_newer_steps_weigh_more() -> None:
    cost = ChunkCost()
    for _ in range(30):
        cost.add(32, 32 * 64, 0.032)
    for _ in range(30):
        cost.add(32, 32 * 64, 0.0032)  # the machine got faster
    fitted = cost.fit()
    assert fitted is not None and fitted.per_token < 0.0002


def test_budget_where_chunks_cost_only_per_token() -> None:
    # a CPU: prompt tokens cost 1 ms each, a decoding step 40 ms: STALL steps' worth of tokens
    assert chunk_budget(0.040, Price(0.0, 0.001)) == int(STALL * 40)
    # and where each token also pays for the positions it attends to: the most n with
    # n * (1 ms + n * 10 us) <= STALL * 40 ms
    n = chunk_budget(0.040, Price(0.0, 0.001, 1e-5))
    assert n * (0.001 + n * 1e-5) <= STALL * 0.040 < (n + 1) * (0.001 + (n + 1) * 1e-5)


def test_more_prompts_waiting_than_streams_decoding_take_more_per_step() -> None:
    # 15 prompts joining beside one decoding stream: their wait weighs fifteen times its stall
    price = Price(0.0, 0.001)
    assert chunk_budget(0.040, price, waiting=15.0) == 15 * chunk_budget(0.040, price)
    assert chunk_budget(0.040, price, waiting=15.0) <= MAX_CHUNK


def test_budget_where_a_chunk_step_has_a_fixed_price() -> None:
    # a GPU: a decoding step is a 6 ms graph, a step with chunks costs 20 ms more whatever its
    # size, and 20 us per token: the step takes as many tokens as cost that price again
    assert chunk_budget(0.006, Price(0.020, 0.00002)) == MAX_CHUNK
    assert chunk_budget(0.006, Price(0.020, 0.0002)) == 100
    assert chunk_budget(0.006, Price(0.0, 1.0)) == MIN_CHUNK
