"""Accounting: admission (quotas); usage and audit subscribe to lifecycle events."""
