"""Typed errors raised at rlix's boundaries.

Every error a user can cause derives from `RlixError`, so the CLI can print it as one line
instead of a traceback.
"""

from __future__ import annotations


class RlixError(Exception):
    """Base class for every error rlix raises on purpose."""


class ConfigError(RlixError):
    """A configuration file or value is invalid; the message names the file and the field."""


class LedgerError(RlixError):
    """A change to the GPU ledger would break one of its invariants; the ledger is unchanged."""


class SchedulerError(RlixError):
    """A scheduler call is invalid (unknown pipeline, duplicate request, impossible size...)."""


class UnknownPipelineError(SchedulerError):
    """The named pipeline is not registered with the scheduler."""


class ScenarioError(ConfigError):
    """A simulator scenario file is invalid."""
