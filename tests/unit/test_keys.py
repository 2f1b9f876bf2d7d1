"""Which keys share a Redis Cluster slot (docs/reliability.md, "Redis Cluster"): those that one
script, transaction or multi-key command touches together must, and tasks must spread."""

from arq.constants import health_check_key_suffix, retry_key_prefix
from redis.crc import key_slot

from lmsp_core.store import keys


def slots(*names: str) -> set[int]:
    return {key_slot(name.encode()) for name in names}


def test_a_tasks_keys_share_a_slot() -> None:
    task = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
    assert len(slots(*keys.script_keys(task), keys.replication_mark(keys.task(task)))) == 1


def test_a_models_queue_its_jobs_fair_share_and_wake_channel_share_a_slot() -> None:
    for model in ("tiny-random", "smollm2:135m-instruct", "odd{model}", "}{"):
        job = keys.job_id("task_01J8M6Q4W2T7N5R3V9X1Z8B0DF", model)
        again = f"{job}:2"  # a reaper's fresh job
        names = [keys.queue(model), keys.queue(model) + health_check_key_suffix, keys.wake_channel(model),
                 keys.active_tasks(model), keys.model_card(model), keys.model_card_digest(model),
                 *keys.fair_queue(model), *keys.arq_job_keys(job), *keys.arq_job_keys(again),
                 retry_key_prefix + job]
        assert len(slots(*names)) == 1, model


def test_keys_updated_together_share_a_slot() -> None:
    assert len(slots(keys.credential("abc"), keys.credential_index(), keys.principals())) == 1
    assert len(slots(keys.workers(), keys.worker("host-1-abc"))) == 1
    assert len(slots(keys.idempotency("acme", "d1"), keys.rate("acme"), keys.streams("acme"))) == 1
    batch = "batch_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
    assert len(slots(keys.batch(batch), keys.batch_lines(batch), keys.batch_tasks(batch), keys.batch_open(batch),
                     keys.batch_results(batch))) == 1
    file = "file-01J8M6Q4W2T7N5R3V9X1Z8B0DF"
    assert len(slots(keys.file(file), keys.file_content(file), keys.file_staging(file, "n1"))) == 1
    conversation = "conv_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
    mark = keys.replication_mark(keys.conversation(conversation))
    assert len(slots(*keys.conversation_keys(conversation), mark)) == 1
    assert len(slots(keys.task_conversation(file), keys.task(file))) == 1
    assert len(slots(keys.webhook("wh_1"), keys.owner_webhooks("acme"), keys.all_webhooks(),
                     keys.webhook_deliveries("wh_1"), keys.delivery("d_1"), keys.deliveries_due())) == 1


def test_tasks_and_principals_spread_over_the_slots() -> None:
    tasks = slots(*(keys.task(f"resp_{i:026d}") for i in range(1000)))
    principals = slots(*(keys.rate(f"principal-{i}") for i in range(1000)))
    assert len(tasks) > 900 and len(principals) > 900


def test_the_hash_tag_is_what_redis_hashes() -> None:
    assert keys.hash_tag("a:{b}:c") == "b"
    assert keys.hash_tag("a:{}:{c}") == "a:{}:{c}"  # an empty first tag: the whole key
    assert keys.hash_tag("plain") == "plain"
    assert keys.hash_tag("a{b") == "a{b"
