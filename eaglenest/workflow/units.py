"""Sizes and times as eaglenest writes them for a person, everywhere (plan.md, the report, the
disk guard, progress lines): decimal units, 1 GB = 10**9 bytes, as disks are sold and as the
Kimi arithmetic in docs/HIDDEN_STATES.md counts; times as h:mm:ss, or seconds with one decimal below a minute."""

GB = 10**9


def size(n):
    """Bytes in decimal units: B, kB, MB, GB, TB (two decimals from GB up)."""
    for unit, scale in (("TB", 10**12), ("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if scale >= GB else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def duration(seconds):
    """Seconds as h:mm:ss, or as `12.3 s` below a minute."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"
