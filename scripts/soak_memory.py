"""Memory tracking for the soak scripts: the device bytes PyTorch holds and the process's current
resident set, sampled every `every` steps after `warmup` steps.

The caller releases its step's temporaries (inputs and reference outputs, sized by the step) before
each sample, so the device figure counts only what outlives a step: it must not move at all. The
resident set moves with Python's own heap, so the verdict compares medians of the first and last
quarters of the samples (a leak shifts the median; one large step does not). A single reading at
the end against one after warm-up (what these scripts did first) compared whichever step-sized
tensors happened to be alive, and the peak resident set (ru_maxrss) only ever rises.
"""
import os
import statistics

import torch


def current_rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


class MemoryTrack:
    def __init__(self, warmup, every=100):
        self.warmup, self.every = warmup, every
        self.device, self.rss = [], []

    def due(self, step):
        return step >= self.warmup and step % self.every == 0

    def sample(self):
        torch.cuda.synchronize()
        self.device.append(torch.cuda.memory_allocated())
        self.rss.append(current_rss_kb())

    def verdict(self):
        """(errors, summary): growth of the device bytes at all, or of the resident set's median
        from the first to the last quarter of the samples by more than 5% + 16 MB."""
        summary = {"samples": len(self.device), "every_steps": self.every}
        if len(self.device) < 8:
            return ["too few memory samples (%d) to judge growth" % len(self.device)], summary
        q = len(self.rss) // 4
        rss_first, rss_last = statistics.median(self.rss[:q]), statistics.median(self.rss[-q:])
        summary.update({"device_bytes_first_max": [self.device[0], max(self.device)],
                        "rss_kb_median_first_last_quarter": [rss_first, rss_last]})
        errors = []
        if max(self.device) > self.device[0]:
            errors.append("device memory grew: %d -> %d bytes" % (self.device[0], max(self.device)))
        if rss_last > rss_first * 1.05 + 16384:
            errors.append("resident set grew: median %d -> %d KB" % (rss_first, rss_last))
        return errors, summary
