"""One fault scenario in which every alert condition holds, as a static exposition.

Run RUN, two ranks (job / instance are added by Prometheus, as for the real server):
  rank 0  every fault: padding mass 2 % unmasked, NaN logits and loss, ghost labels, loss
          spikes, blind steps (coverage), input ids on untrained rows (warn), halted by
          nonfinite, dropped reports; reporting now.
  rank 1  healthy numbers, the same padding mass but masked, never blind (its coverage count
          is exposed at 0, as guard-server exposes every enabled check), and silent for 10
          minutes.
`fault_exposition` is guard-server's /metrics text, served by `serve_exposition`; its
counters grow by one per scrape, so rate() and increase() see real increments.

A real guard-server fed by a real training run is test_live_training.py; this static form
stays because it holds what a live server cannot show within a test: a rank silent for
minutes (GuardRankSilent; the server stamps report times itself) and every alert firing for
one rank at once, with a metric text that `promtool check metrics` lints.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RUN = "test-run.1"  # the dot checks that the dashboard's regex matchers escape run ids
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus 3 needs it exact

# Which ranks each alert must fire for (test_live_queries.py); absent: fires for none.
FIRING = {
    "GuardNonFinite": {"0"},
    "GuardPaddingMassHigh": {"0"},  # rank 1 has the same mass but its mask keeps it out
    "GuardHalted": {"0"},
    "GuardTokenOutOfRange": {"0"},
    "GuardLossSpike": {"0"},
    "GuardRankSilent": {"1"},
    "GuardReportsDropped": {"0"},
    "GuardBlind": {"0"},
    "GuardUntrainedTokens": {"0"},
}
VOCAB = {"real": 50000, "rows": 50016, "aligned": 50048}  # 50000 rounded up to 64: 50048


Render = Callable[[int, float], str]


def fault_exposition(scrape: int, now: float) -> str:
    """The text format for the `scrape`-th scrape (1-based) at unix time `now`."""
    r0 = f'run_id="{RUN}",rank="0"'
    r1 = f'run_id="{RUN}",rank="1"'
    n = scrape
    families: list[tuple[str, str, list[tuple[str, float]]]] = [
        ("guard_step", "gauge", [(r0, 100 + n), (r1, 40)]),
        ("guard_last_report_timestamp_seconds", "gauge", [(r0, now), (r1, now - 600)]),
        ("guard_rank_finished", "gauge", [(r0, 0), (r1, 0)]),  # neither detached
        ("guard_loss", "gauge", [(r0, 87.3), (r1, 2.1)]),
        ("guard_padding_mass_ratio", "gauge", [(r0, 0.99), (r1, 0.99)]),  # garbage rows
        ("guard_padding_mass_max_ratio", "gauge", [(r0, 1.0), (r1, 1.0)]),
        ("guard_nonfinite_values_total", "counter", [
            (f'{r0},tensor="logits"', 4 + n), (f'{r0},tensor="hidden"', 0),
            (f'{r0},tensor="loss"', n), (f'{r1},tensor="logits"', 0),
            (f'{r1},tensor="hidden"', 0), (f'{r1},tensor="loss"', 0),
        ]),
        ("guard_out_of_range_tokens_total", "counter", [
            (f'{r0},kind="input"', 0), (f'{r0},kind="label"', 3 * n),
            (f'{r1},kind="input"', 0), (f'{r1},kind="label"', 0),
        ]),
        ("guard_untrained_rows", "gauge", [
            (f'{r0},weight="embedding"', 250), (f'{r0},weight="lm_head"', 250),
            (f'{r1},weight="embedding"', 0), (f'{r1},weight="lm_head"', 0),
        ]),
        ("guard_untrained_tokens_total", "counter", [
            (f'{r0},kind="input"', 6 * n), (f'{r0},kind="label"', 0),
            (f'{r1},kind="input"', 0), (f'{r1},kind="label"', 0),
        ]),
        ("guard_violations_total", "counter", [
            (f'{r0},check="loss_spike",action="warn"', n),
            (f'{r0},check="padding_mass",action="warn"', 5 * n),
            (f'{r0},check="nonfinite",action="fail"', 1),
            (f'{r1},check="padding_mass",action="mask"', 0),  # the mask did its job
            (f'{r0},check="coverage",action="warn"', n),
            (f'{r1},check="coverage",action="warn"', 0),
        ]),
        ("guard_skipped_steps_total", "counter", [(r0, n), (r1, 0)]),
        ("guard_grad_norm", "gauge", [(r0, 1e18), (r1, 0.8)]),  # a near-zero row dominates
        ("guard_logsumexp", "gauge", [(r0, 31.0), (r1, 10.8)]),
        ("guard_logsumexp_max", "gauge", [(r0, 45.0), (r1, 11.2)]),
        ("guard_scaler_skipped_steps_total", "counter", [(r0, 2 * n), (r1, 0)]),
        ("guard_halted", "gauge", [(f'{r0},check="nonfinite"', 1)]),
        ("guard_vocab_size", "gauge", [
            (f'{r},kind="{kind}"', size)
            for r in (r0, r1)
            for kind, size in VOCAB.items()
        ]),
        ("guard_dropped_reports_total", "counter", [(r0, 7 * n), (r1, 0)]),
        ("guard_ingest_reports_total", "counter", [("", 240 * n)]),
        ("guard_ingest_rejected_total", "counter", [
            ('reason="unauthorized"', n), ('reason="invalid"', 2),
        ]),
        ("guard_ingest_unknown_fields_total", "counter", [('field="reports.z_loss"', n)]),
        ("guard_server_runs", "gauge", [("", 1)]),
        ("guard_server_ranks", "gauge", [("", 2)]),
        ("guard_server_bytes", "gauge", [("", 12288)]),
    ]  # fmt: skip
    lines = []
    for name, kind, samples in families:
        lines += [f"# HELP {name} {name} for the dashboard tests.", f"# TYPE {name} {kind}"]
        lines += [
            f"{name}{{{labels}}} {value}" if labels else f"{name} {value}"
            for labels, value in samples
        ]
    return "\n".join(lines) + "\n"


@contextmanager
def serve_exposition(render: Render = fault_exposition) -> Iterator[str]:
    """Serve `render(scrape, time.time())` at http://127.0.0.1:PORT/metrics; yield "host:port"."""
    scrapes = 0
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            nonlocal scrapes
            if self.path != "/metrics":
                self.send_error(404)
                return
            with lock:
                scrapes += 1
                body = render(scrapes, time.time()).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per scrape would bury the test output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="exposition", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
