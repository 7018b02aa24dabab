"""Data: rows -> chat-template tokens with assistant-only loss masks -> jagged batches."""
