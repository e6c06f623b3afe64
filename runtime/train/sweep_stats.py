"""A sweep's verdict: each setting's final val loss over its seeds (mean and sample standard
deviation), and its difference from the first setting, in standard errors of that
difference, called real when it is more than REAL of them (RULE says so under the table)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

REAL = 2.0
RULE = (f"real: |Δ| > {REAL:g} standard errors of the difference, SE = √(s₀²/n₀ + s²/n), s the "
        "sample std of the final val loss over the seeds, n the seeds (with 2 or 3 seeds a "
        "rough guide, not a test)")


@dataclass(frozen=True)
class SettingStats:
    setting: tuple[tuple[str, str], ...]
    losses: tuple[float, ...]     # the final val loss of each of its finished runs
    mean: float | None
    std: float | None             # sample std (n - 1); None below 2 seeds
    diff: float | None            # mean - the first setting's; None for the first
    z: float | None               # diff / SE; None where a std is missing
    first: bool                   # the setting the others are measured from

    @property
    def real(self) -> bool | None:
        return None if self.z is None else abs(self.z) > REAL


def setting_stats(groups) -> list[SettingStats]:
    """`groups`: (setting, final val losses) in grid order; the first setting with a loss
    is the one the others are measured from."""
    found = [(setting, tuple(losses)) for setting, losses in groups]
    base = next(((s, ls) for s, ls in found if ls), None)
    out = []
    for setting, losses in found:
        mean = statistics.fmean(losses) if losses else None
        std = statistics.stdev(losses) if len(losses) > 1 else None
        diff = z = None
        if base is not None and losses and setting != base[0]:
            diff = mean - statistics.fmean(base[1])
            z = _z(diff, base[1], losses)
        out.append(SettingStats(setting, losses, mean, std, diff, z,
                                first=base is not None and setting == base[0]))
    return out


def _z(diff: float, a: tuple[float, ...], b: tuple[float, ...]) -> float | None:
    if len(a) < 2 or len(b) < 2:
        return None
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return diff / se if se else (0.0 if diff == 0 else math.copysign(math.inf, diff))


def settings_table(stats: list[SettingStats], title: str = "settings"):
    """The rich Table of the settings: a column a swept key, then the seeds, the mean and
    spread of the final val loss, and the difference from the first setting."""
    from rich.table import Table

    table = Table(title=title)
    keys = [k for k, _ in stats[0].setting] if stats else []
    for key in keys:
        table.add_column(key)
    for column in ("seeds", "final val", "± std", "Δ", "Δ / SE", "real"):
        table.add_column(column, justify="right")
    for s in stats:
        table.add_row(*(v for _, v in s.setting), str(len(s.losses)),
                      _num(s.mean, "{:.4f}"), _num(s.std, "{:.4f}"),
                      "(first)" if s.first else _num(s.diff, "{:+.4f}"), _num(s.z, "{:+.1f}"),
                      "" if s.first else {None: "–", True: "yes", False: "no"}[s.real])
    return table


def _num(value: float | None, form: str) -> str:
    return "–" if value is None else form.format(value)
