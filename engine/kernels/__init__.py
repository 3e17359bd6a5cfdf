"""Compute operations, one file per operation: each holds its plain-torch reference (and, where it pays, the
Triton kernel with the same signature), chosen by a dispatcher."""
