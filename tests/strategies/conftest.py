"""Fixtures of this folder."""

from _s3_server import s3_bucket

__all__ = ["s3_bucket"]
