"""Turns a scale report (benchmarks/scale.py's JSON) into the benchmark table of docs/benchmarks.md and one PNG
figure per scenario.

    .venv/bin/python benchmarks/report.py benchmarks/results/scale-2026-11-30.json [--no-readme]

The table replaces what stands between docs/benchmarks.md's `<!-- bench:begin -->` and
`<!-- bench:end -->` markers; the figures go next to the JSON (`<json stem>-<scenario>.png`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        value = f"{value:.3g}" if value < 10 else f"{value:,.0f}"
    return f"{value}{unit}"


def table(report: dict[str, Any], source: str) -> str:
    rows: list[tuple[str, str, str]] = []  # (what, measured, goal)
    for point in report.get("launch", []):
        tag = f"{int(point['ratePerSecond'])}/s" if point.get("ratePerSecond") else "full speed"
        t, j = point["tether"], point["jobs"]
        rows.append((f"launch {point['runs']} at {tag}: create→pod p50 / p99, Tether vs Jobs",
                     f"{_fmt(t['createToPod'].get('p50'))} / {_fmt(t['createToPod'].get('p99'))} s vs "
                     f"{_fmt(j['createToPod'].get('p50'))} / {_fmt(j['createToPod'].get('p99'))} s",
                     "p99 ≤ 1 s at 20/s" if point.get("ratePerSecond") else ""))
        rows.append((f"launch {point['runs']} at {tag}: create→Running p99; pods/s, Tether vs Jobs",
                     f"{_fmt(t['createToRunning'].get('p99'))} vs {_fmt(j['createToRunning'].get('p99'))} s; "
                     f"{_fmt(t['podsPerSecond'])} vs {_fmt(j['podsPerSecond'])}/s",
                     "" if point.get("ratePerSecond") else "Tether ≥ 2× Jobs"))
    burst = report.get("burst")
    if burst:
        g = burst["createToGranted"]
        rows.append((f"burst of {burst['runs']} External runs: all granted after; create→granted p50 / p99; grants/s",
                     f"{_fmt(burst['allGrantedSeconds'])} s; {_fmt(g.get('p50'))} / {_fmt(g.get('p99'))} s; "
                     f"{_fmt(burst['grantsPerSecond'])}/s", "all within 20 s at qps 100"))
        writes = burst["writesPerGrant"]
        rows.append((f"burst of {burst['runs']} External runs: API writes and reads per grant; operator CPU per grant",
                     f"{_fmt(sum(writes.values()))} ({', '.join(f'{k} {_fmt(v)}' for k, v in writes.items())}); "
                     f"{_fmt(sum((burst.get('readsPerGrant') or {}).values()))}; "
                     f"{_fmt(burst['operatorCpuMsPerGrant'])} ms", "status and Lease"))
    for s in report.get("steady", []):
        what = f"{s['runs']} live runs, L={s['leaseSeconds']} s / renew {s['renewSeconds']} s"
        rows.append((f"{what}: operator CPU, RSS", f"{_fmt(s['operatorCores'])} cores, "
                     f"{_fmt(s['operatorRssMiBPeak'])} MiB", "≤ 0.5 core, ≤ 300 MiB"))
        w = s["apiWritesPerHeartbeat"]
        net = w.get("workerrunsNetOfLapses")
        rows.append((f"{what}: API writes per heartbeat (Lease, WorkerRun; WorkerRun net of the lapses' own)",
                     f"{_fmt(w['leases'])}, {_fmt(w['workerruns'])}"
                     f"{'' if net is None else '; ' + _fmt(net)} ({_fmt(s['renewalsPerSecond'])} renewals/s)",
                     "1, 0"))
        machine = s.get("machineCores")
        if machine:
            rows.append((f"{what}: cores used by the rest of the host",
                         ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(machine.items(), key=lambda kv: -kv[1])), ""))
        lag = s.get("watchLagSeconds") or {}
        rows.append((f"{what}: watch lag p50 / p99", f"{_fmt(lag.get('p50'))} / {_fmt(lag.get('p99'))} s", ""))
        d = s["lapseDetectionSeconds"]
        rows.append((f"{what}: lapse detection p50 / p99 / max ({d.get('n', 0)} of {s['lapsesSampled']} sampled); "
                     "false Lost (lost by the fleet's own missed renewals)",
                     f"{_fmt(d.get('p50'))} / {_fmt(d.get('p99'))} / {_fmt(d.get('max'))} s; "
                     f"{s['falseLost']} ({(s.get('fleetMissedRenewals') or {}).get('lost', 0)})",
                     f"p99 ≤ {s['leaseSeconds'] + 2} s; 0"))
        prof = s.get("operatorProfile")
        if prof:
            top = ", ".join(f"{k} {round(100 * v)}%" for k, v in list(prof["byModule"].items())[:5])
            rows.append((f"{what}: where the operator's CPU goes (py-spy, {prof['samples']} samples)", top, ""))
    r = report.get("restart")
    if r:
        rows.append((f"restart (kill -9) under {r['runs']} runs: all re-observed; requests, peak/s; false Lost",
                     f"{_fmt(r['allObservedAfterSeconds'])} s; {r['requestsAfterRestart']}, "
                     f"{_fmt(r['peakRequestsPerSecond'])}/s (qps {r['qps']}); {r['falseLost']}", "≤ 30 s; 0"))
    b = report.get("budget")
    if b:
        rows.append((f"{b['runs']} runs on one budget: charge conflicts/s, cents charged/s of reported/s, "
                     "budget writes/s, budget size, starved runs",
                     f"{_fmt(b['chargeConflictsPerSecond'])}, {_fmt(b['centsChargedPerSecond'])} of "
                     f"{_fmt(b.get('centsReportedPerSecond'))}, {_fmt(b.get('budgetWritesPerSecond'))}, "
                     f"{_fmt(b['budgetBytes']['max'])} B, {b['starvedRuns']}", "bounded; 0 starved"))
    c = report.get("ceiling")
    if c:
        top = c["steps"][-1]["runs"] if c["steps"] else None
        rows.append(("ceiling: most live runs meeting every goal; what broke first",
                     f"{_fmt(c.get('ceiling'))}; {', '.join(c.get('firstBroken') or []) or 'nothing up to ' + str(top)}",
                     ""))
    smoke = " (smoke size: not a measurement)" if report.get("smoke") else ""
    head = (f"Measured {report['date']} on one host with {report['machine']['cpus']} cores, Tether's client "
            f"qps {report['tether']['qps']} / burst {report['tether']['burst']}, kube-controller-manager "
            f"{report['kubeControllerManager']['qps']} / {report['kubeControllerManager']['burst']}{smoke}; "
            f"`{source}`.\n\n")
    lines = ["| scenario | measured | goal |", "|---|---|---|"] + [f"| {a} | {m} | {g} |" for a, m, g in rows]
    return head + "\n".join(lines) + "\n"


def update_readme(text: str, readme: Path = ROOT / "docs" / "benchmarks.md") -> None:
    body = readme.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers")
    before, rest = body.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    readme.write_text(f"{before}{BEGIN}\n{text}{END}{after}")


def figures(report: dict[str, Any], stem: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415 - only `make bench` needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = stem.with_name(f"{stem.name}-{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        out.append(path)

    if report.get("launch"):
        fig, axes = plt.subplots(1, len(report["launch"]), figsize=(5 * len(report["launch"]), 3.5), squeeze=False)
        for ax, point in zip(axes[0], report["launch"], strict=True):
            labels, tether, jobs = [], [], []
            for metric in ("createToPod", "createToRunning"):
                for q in ("p50", "p99"):
                    labels.append(f"{metric[8:]} {q}")
                    tether.append(point["tether"][metric].get(q) or 0)
                    jobs.append(point["jobs"][metric].get(q) or 0)
            xs = range(len(labels))
            ax.bar([x - 0.2 for x in xs], tether, 0.4, label="WorkerRun (Tether)")
            ax.bar([x + 0.2 for x in xs], jobs, 0.4, label="Job (kube-controller-manager)")
            ax.set_xticks(list(xs), labels, fontsize=8)
            ax.set_ylabel("seconds after create")
            rate = f"{int(point['ratePerSecond'])}/s" if point.get("ratePerSecond") else "full speed"
            ax.set_title(f"launch {point['runs']} at {rate}")
            ax.legend(fontsize=7)
        save(fig, "launch")
    if report.get("steady"):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        names = [f"{s['runs']} runs\nL={s['leaseSeconds']}s" for s in report["steady"]]
        axes[0].bar(names, [s["operatorCores"] for s in report["steady"]])
        axes[0].axhline(0.5, color="red", linestyle="--", label="goal")
        axes[0].set_ylabel("operator CPU (cores)")
        axes[0].legend(fontsize=7)
        axes[1].bar(names, [s["operatorRssMiBPeak"] for s in report["steady"]])
        axes[1].axhline(300, color="red", linestyle="--")
        axes[1].set_ylabel("operator RSS peak (MiB)")
        save(fig, "steady")
    if report.get("restart"):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(report["restart"]["requestsPerSecond"])
        ax.set_xlabel("seconds after kill -9 and restart")
        ax.set_ylabel("operator requests / s")
        ax.set_title(f"restart under {report['restart']['runs']} live runs")
        save(fig, "restart")
    if report.get("ceiling") and report["ceiling"]["steps"]:
        # The first steady point (same lease) and the ceiling's steps: CPU and RSS against their goals.
        first = [s for s in report.get("steady", [])[:1]]
        points = [(s["runs"], s["operatorCores"], s["operatorRssMiBPeak"]) for s in first] + \
            [(s["runs"], s["operatorCores"], s["operatorRssMiBPeak"]) for s in report["ceiling"]["steps"]]
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
        for ax, i, goal, label in ((axes[0], 1, 0.5, "operator CPU (cores)"), (axes[1], 2, 300, "operator RSS (MiB)")):
            ax.plot([pt[0] for pt in points], [pt[i] for pt in points], marker="o")
            ax.axhline(goal, color="red", linestyle="--", label="goal")
            ax.set_xlabel("live runs")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        fig.suptitle("ceiling (L = 90 s); the ceiling's steps come after a restart", fontsize=9)
        save(fig, "ceiling")
    if report.get("budget"):
        b = report["budget"]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(["conflicts/s", "budget\nwrites/s", "reconciles/s", "cents\ncharged/s", "cents\nreported/s"],
               [b["chargeConflictsPerSecond"], b.get("budgetWritesPerSecond", 0), b["reconcilesPerSecond"],
                b["centsChargedPerSecond"], b.get("centsReportedPerSecond", 0)])
        ax.set_title(f"{b['runs']} runs on one budget")
        save(fig, "budget")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args()
    path = Path(args.report)
    report = json.loads(path.read_text())
    if not args.no_figures:
        for fig in figures(report, path.with_suffix("")):
            print(f"wrote {fig}")
    if not args.no_readme:
        update_readme(table(report, f"make bench → {path.relative_to(ROOT) if path.is_absolute() else path}"))
        print("docs/benchmarks.md benchmark table updated")


if __name__ == "__main__":
    main()
