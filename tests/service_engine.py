"""A stand-in engine for tests of eaglenest.engine.service: the service's lifecycle and
protocol without vLLM (the real engines are tested through Snakemake in test_hidden_states_vllm
and test_generate_parts)."""

import logging
import os
import time

from eaglenest.workflow.errors import InputError

log = logging.getLogger("eaglenest.tests.service_engine")


class Echo:
    def __init__(self, factor):
        if factor < 0:
            raise InputError(f"config.yaml: field 'factor': {factor} is negative")
        self.factor = factor
        log.info("loaded")

    def times(self, n, *, lines=0):
        for i in range(lines):
            log.info("line %d of %d", i + 1, lines)
        return n * self.factor

    def pid(self):
        return os.getpid()

    def hold(self, seconds, name):
        """(start, end) of `seconds` spent on this request, in the service's clock."""
        start = time.monotonic()
        log.info("%s holding", name)
        time.sleep(seconds)
        return start, time.monotonic()

    def refuse(self, where):
        raise InputError(f"{where}: field 'x': bad")

    def crash(self):
        raise ZeroDivisionError("boom")

    def close(self):
        pass


class ConcurrentEcho(Echo):
    serves_concurrently = True  # takes requests from every connection's thread at once
