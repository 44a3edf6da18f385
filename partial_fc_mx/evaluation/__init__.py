"""Verification of face embeddings on pairs (insightface .bin sets)."""
