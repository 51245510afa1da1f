"""What a `generate_many` run reports (issue 36, part 3): per-output time to first token and finish reason, tokens,
queue, pages and prefix hits in a `GenerationStats` and on the tqdm bar; `RaggedCache.stats()` with
`PagedCache.stats()`'s fields; a Prometheus endpoint whose counters move during a run."""

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LogitsProcessor, LogitsProcessorList

import hf_paged
import hf_paged.metrics
from hf_paged import stats as run_stats
from test_generate_many import random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
PAGE = 4


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def system_prompts(count=4):
    """Prompts sharing a 12-token system prompt (3 full pages of 4)."""
    system = random_prompts((12,), seed=30)[0]
    return [system + p for p in random_prompts(tuple(range(3, 3 + count)), seed=31)]


class Recorder:
    """A stats observer that keeps what it hears."""

    def __init__(self):
        self.steps, self.first, self.done = [], [], []

    def step(self, stats, *, prompt_tokens, generated, prefix_hits):
        self.steps.append(dict(queue=stats.queue_length, running=stats.running, used=stats.pages_used,
                               generated=generated, prompt_tokens=prompt_tokens, prefix_hits=prefix_hits))

    def first_token(self, stats, output):
        self.first.append(output.index)

    def finished(self, stats, output):
        self.done.append((output.index, output.finish_reason))


@pytest.fixture
def recorder():
    observer = Recorder()
    run_stats.add_observer(observer)
    yield observer
    run_stats.remove_observer(observer)


def test_a_run_reports_its_outputs_tokens_queue_pages_and_prefix_hits(llama, recorder):
    _, paged = llama
    prompts = system_prompts()
    news = [5, 3, 6, 4]
    cache = hf_paged.RaggedCache(paged.config, page_size=PAGE, max_pages=12)  # room for two rows at a time
    stop = hf_paged.generate_many(paged, prompts, max_new_tokens=news, eos_token_id=[], cache=cache,
                                  progress=False)[1][1]
    hits_before = cache.prefix_hits
    recorder.__init__()  # the second run only
    out = hf_paged.generate_many(paged, prompts, max_new_tokens=news, eos_token_id=stop, cache=cache,
                                 max_batch_tokens=8, return_dict_in_generate=True, progress=False)
    stats = out.stats
    assert [o.new_tokens for o in stats.outputs] == [len(s) for s in out.sequences]
    assert stats.generated_tokens == sum(map(len, out.sequences)) == sum(s["generated"] for s in recorder.steps)
    assert out.finish_reasons[1] == "stop_token" and "length" in out.finish_reasons
    assert sorted(recorder.done) == sorted(enumerate(out.finish_reasons))
    assert sorted(recorder.first) == [0, 1, 2, 3]
    for o in stats.outputs:
        assert 0 <= o.admitted_s <= o.first_token_s <= o.finished_s <= stats.elapsed_s
    assert stats.prefix_hits == cache.prefix_hits - hits_before > 0  # the system prompt, from the first run
    assert stats.prompt_tokens_computed + stats.prefix_hits * PAGE == sum(map(len, prompts))
    assert stats.steps == len(recorder.steps) and stats.forward_s <= stats.elapsed_s
    assert max(s["queue"] for s in recorder.steps) > 0 and recorder.steps[-1]["queue"] == 0  # prompts waited
    assert max(s["used"] for s in recorder.steps) <= 12 and stats.pages_used == 0 and stats.running == 0
    assert stats.tokens_per_s > 0 and stats.summary()["finish_reasons"]["stop_token"] >= 1


def test_ragged_cache_stats_have_the_paged_caches_fields(llama):
    _, paged = llama
    prompts = system_prompts(2)
    ragged = hf_paged.RaggedCache(paged.config, page_size=PAGE)
    hf_paged.generate_many(paged, prompts, max_new_tokens=3, eos_token_id=[], cache=ragged, progress=False)
    got = ragged.stats()
    pages = hf_paged.PagedCache(page_size=PAGE, config=paged.config)
    paged.generate(torch.tensor([prompts[0]]), max_new_tokens=3, cache=pages, pad_token_id=0)
    assert set(got) == set(pages.stats())
    assert got["pages_used"] == 0 and got["tokens_stored"] == 0  # every row gave its pages back
    assert got["pages_cached"] > 0 and got["prefix_hits"] == ragged.prefix_hits
    assert got["pages_total"] == got["pages_free"] + got["pages_cached"]
    assert got["kv_bytes"] == got["pages_cached"] * ragged.page_bytes() > 0


def test_the_progress_bar_shows_throughput_queue_pages_and_ttft(llama, capsys):
    _, paged = llama
    hf_paged.generate_many(paged, system_prompts(2), max_new_tokens=3, eos_token_id=[], progress=True)
    bar = capsys.readouterr().err
    for field in ("tok/s=", "queue=", "running=", "pages=", "prefix hits=", "ttft="):
        assert field in bar, bar


def scrape(port: int) -> dict[str, float]:
    """Every sample of the endpoint, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


class ScrapeAt(LogitsProcessor):
    """Scrapes the endpoint at the ``at``-th call (mid-run); changes nothing."""

    def __init__(self, port, at):
        self.port, self.at, self.calls, self.seen = port, at, 0, None

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            self.seen = scrape(self.port)
        return scores


def test_a_prometheus_scrape_during_a_run_sees_the_counters_move(llama):
    _, paged = llama
    exporter = hf_paged.metrics.start_http_server(0, addr="127.0.0.1")
    try:
        before = scrape(exporter.port)
        probe = ScrapeAt(exporter.port, at=10)
        out = hf_paged.generate_many(paged, system_prompts(), max_new_tokens=6, eos_token_id=[], page_size=PAGE,
                                     max_pages=12, logits_processor=LogitsProcessorList([probe]),
                                     return_dict_in_generate=True, progress=False)
        after = scrape(exporter.port)
    finally:
        exporter.close()
    mid = probe.seen
    tokens = "hf_paged_generated_tokens_total"
    assert before[tokens] == 0 < mid[tokens] < after[tokens] == out.stats.generated_tokens == 24
    assert before["hf_paged_steps_total"] < mid["hf_paged_steps_total"] < after["hf_paged_steps_total"]
    assert after["hf_paged_prompt_tokens_total"] == out.stats.prompt_tokens_computed
    assert after["hf_paged_prefix_hit_pages_total"] == out.stats.prefix_hits
    assert after["hf_paged_finished_outputs_total{reason=length}"] == 4
    assert after["hf_paged_time_to_first_token_seconds_count"] == 4
    assert mid["hf_paged_pages_used"] > 0 and after["hf_paged_queue_length"] == 0
    assert exporter not in run_stats.observers()  # closed: later runs are not counted


def test_an_exporter_on_a_registry_of_ones_own_counts_without_a_server(llama):
    from prometheus_client import CollectorRegistry

    _, paged = llama
    registry = CollectorRegistry()
    exporter = hf_paged.metrics.PrometheusExporter(registry)
    try:
        hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=3, eos_token_id=[], progress=False)
    finally:
        exporter.close()
    hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=3, eos_token_id=[], progress=False)
    assert registry.get_sample_value("hf_paged_generated_tokens_total") == 3 and exporter.port is None
