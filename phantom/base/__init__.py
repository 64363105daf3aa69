"""Foundations with no domain: JSON read within bounds, fault points, the dtype table, checksums, atomic file replaces, provenance records."""
