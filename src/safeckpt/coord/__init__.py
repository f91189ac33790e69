"""Cross-rank coordination: the decide/run exchanges on safeckpt's own gloo group, peer
liveness, the writer lease on a root, preemption agreement and the verification split.

The only layer that runs collectives (``coord.dist``); imports storage and format below it.
"""
