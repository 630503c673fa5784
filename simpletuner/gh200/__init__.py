"""GH200 / GB10 layer: unified-memory hints, in-memory datasets, the accumulation ramp."""
