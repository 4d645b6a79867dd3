"""Tests of specserve.server."""
