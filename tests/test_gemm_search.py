"""runtime/engine/gemm_search.py without a GPU: which candidate `choose` keeps, the record of
choices on disk (written atomically, merged with another process's, an unreadable file read
as empty), and `Search.pick` (a recorded algorithm is run again without timing; none is
timed while capturing). The timed calls themselves run on the GPU
(tests/gpu/test_gemm_gpu.py)."""
from __future__ import annotations

import json

import pytest

from eulergen.runtime.engine import gemm_search
from eulergen.runtime.engine.gemm_search import Record, Search, choose, key_text

KEY = (14, 14, 68, 1, 0, 2304, 8192, 768, 768, 768, 2304, 1, (256, 256, 256, 256), 33554176)
ALGOS = [bytes([i]) * 64 for i in range(4)]


@pytest.mark.parametrize("seconds, want", [
    ([1.0, 0.99, 0.98, 1.2], 0),       # within the margin: the heuristic's first
    ([1.0, 0.99, 0.9, 0.95], 2),       # 10% faster: taken
    ([None, 2.0, 1.5], 2),             # the first did not run: the fastest that did
    ([None, None], 0),                 # none ran: the first (its launch will say why)
    ([1.0], 0),
])
def test_choose_keeps_the_first_unless_another_is_clearly_faster(seconds, want):
    assert choose(seconds) == want


def test_a_pick_is_recorded_and_a_later_process_runs_it_without_timing(tmp_path):
    path = tmp_path / "gemm" / "gpu.json"
    timed = []

    def timer(i):
        timed.append(i)
        return [1.0, 0.5, 0.8, None][i]

    assert Search(Record(path)).pick(KEY, ALGOS, timer) == 1
    # a warming round, then the rounds, each taking the candidates in turn; the one that
    # failed is not tried again
    assert timed == [0, 1, 2, 3] + [0, 1, 2] * gemm_search.REPEATS
    entry = json.loads(path.read_text())["algorithms"][key_text(KEY)]
    assert entry == {"algo": ALGOS[1].hex(), "us": [1e6, 5e5, 8e5, None]}
    later = Search(Record(path))   # another process: the file, no timing
    assert later.pick(KEY, ALGOS, lambda i: pytest.fail("timed a recorded GEMM")) == 1
    # the heuristic lists its candidates in another order: found by value
    assert later.pick(KEY, ALGOS[::-1], None) == 2


def test_a_recorded_algorithm_the_heuristic_no_longer_offers_is_timed_again(tmp_path):
    path = tmp_path / "g.json"
    Search(Record(path)).pick(KEY, ALGOS, lambda i: [1.0, 0.5, 1.0, 1.0][i])
    others = [bytes([9 + i]) * 64 for i in range(3)]
    assert Search(Record(path)).pick(KEY, others, lambda i: [1.0, 1.0, 0.2][i]) == 2
    assert Record(path).get(key_text(KEY)) == others[2]


def test_a_candidate_is_timed_by_the_median_of_its_rounds():
    # the calls in order: a warming round (slow, as the clocks ramp: not counted), then
    # REPEATS rounds of candidates 0 and 1; candidate 1 fails in the last one
    times = iter([9.0, 9.0, 3.0, 1.0, 1.0, 3.0, 2.0, 2.0, 1.0, 3.0, 1.0, None])
    assert gemm_search.REPEATS == 5
    assert gemm_search.measure(lambda i: next(times), 2) == [1.0, None]


def test_while_capturing_or_with_nothing_timed_the_heuristic_first_runs_unrecorded(tmp_path):
    path = tmp_path / "g.json"
    assert Search(Record(path)).pick(KEY, ALGOS, None) == 0
    assert Search(Record(path)).pick(KEY, ALGOS[:1], lambda i: 1.0) == 0   # one candidate
    assert Search(Record(path)).pick(KEY, ALGOS, lambda i: None) == 0      # none ran
    assert not path.exists()


def test_two_processes_recording_at_once_keep_both_choices(tmp_path):
    path = tmp_path / "g.json"
    first, second = Record(path), Record(path)   # both read the file before either wrote
    other = KEY[:5] + (3072,) + KEY[6:]
    first.put(key_text(KEY), ALGOS[1], [1.0, 0.5])
    second.put(key_text(other), ALGOS[2], [1.0, 0.5])
    again = Record(path)
    assert again.get(key_text(KEY)) == ALGOS[1] and again.get(key_text(other)) == ALGOS[2]
    assert [p.name for p in path.parent.iterdir()] == ["g.json"]   # no temp files left


@pytest.mark.parametrize("text", ["{not json", '{"format": 99, "algorithms": {}}', "[]",
                                  '{"format": 1, "algorithms": {"k": {"algo": "zz"}}}',
                                  '{"format": 1, "algorithms": {"k": 3}}'])
def test_an_unreadable_record_is_empty_and_written_over(tmp_path, text):
    path = tmp_path / "g.json"
    path.write_text(text)
    record = Record(path)
    assert record.get("k") is None and record.get(key_text(KEY)) is None
    assert Search(record).pick(KEY, ALGOS, lambda i: [1.0, 0.1, 1.0, 1.0][i]) == 1
    assert Record(path).get(key_text(KEY)) == ALGOS[1]


def test_the_record_is_named_by_the_gpu_and_the_library_version(tmp_path, monkeypatch):
    monkeypatch.setenv("EULERGEN_CACHE", str(tmp_path))
    path = gemm_search.record_path("NVIDIA H200 (sm_90) 132 sms", 130400)
    assert path == tmp_path / "gemm" / "nvidia-h200-sm-90-132-sms-cublaslt130400.json"
    assert gemm_search.record_path("/../", 1).name == "gpu-cublaslt1.json"
