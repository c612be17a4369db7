"""The py-spy summary the GPU check prints: samples by thread, inclusive and self."""

from __future__ import annotations

import gzip

from mlx_parallm_provider.bench.spy_summary import ENGINE_THREAD, main, markdown, parse

RAW = """\
thread (7): mlx-parallm-worker;_run (mlx_parallm_provider/c.py:190);step (mlx_parallm_provider/c.py:209);run (mlx_lm/r.py:40);eval (mlx_lm/x.py:3) 60
thread (7);_run (mlx_parallm_provider/c.py:190);step (mlx_parallm_provider/c.py:208);schedule (mlx_parallm_provider/sched.py:12) 30
thread (7): mlx-parallm-worker;_run (mlx_parallm_provider/c.py:190);walk (mlx_parallm_provider/a.py:1);walk (mlx_parallm_provider/a.py:2) 10
thread (1): MainThread;select (selectors.py:468) 1
thread (3): asyncio_0;_worker (concurrent/futures/thread.py:89) 150
not a sample line
"""


def test_samples_are_counted_by_thread_id_with_line_numbers_dropped() -> None:
    threads = parse(RAW.splitlines())
    assert sorted(threads) == ["1", "3", "7"]
    worker = threads["7"]
    assert worker.name == "thread 7: mlx-parallm-worker" and worker.samples == 100
    # a function on the stack twice (recursion) counts once per sample
    assert worker.inclusive["step (mlx_parallm_provider/c.py)"] == 90
    assert worker.inclusive["walk (mlx_parallm_provider/a.py)"] == 10
    assert worker.inclusive["_run (mlx_parallm_provider/c.py)"] == 100
    assert dict(worker.self_time) == {"eval (mlx_lm/x.py)": 60, "schedule (mlx_parallm_provider/sched.py)": 30,
                                      "walk (mlx_parallm_provider/a.py)": 10}


def test_the_table_lists_the_engine_worker_first_then_busy_threads_and_own_code_inclusive(capsys, tmp_path) -> None:
    text = markdown(parse(RAW.splitlines()), top=2)
    assert text.startswith("## thread 7: mlx-parallm-worker: 100 samples (40% of all)")
    assert "## thread 3: asyncio_0: 150 samples (60% of all)" in text  # busier, after the worker
    assert "| 60.0 | eval (mlx_lm/x.py) |\n| 30.0 | schedule" in text  # self, top 2
    assert "| 100.0 | _run (mlx_parallm_provider/c.py) |\n| 90.0 | step" in text  # inclusive, top 2
    assert "MainThread" not in text  # 0.4% of the samples
    assert "selectors" not in text
    raw = tmp_path / "profile.txt"
    raw.write_text(RAW)
    with gzip.open(tmp_path / "profile.txt.gz", "wt") as packed:
        packed.write(RAW)
    for path in (raw, tmp_path / "profile.txt.gz"):
        main([str(path), "--top", "2"])
        assert capsys.readouterr().out.strip() == text.strip()


def test_the_thread_put_first_is_the_engines_step_loop() -> None:
    from mlx_parallm_provider.engine.core import WORKER_THREAD_NAME

    assert ENGINE_THREAD == WORKER_THREAD_NAME
