"""What a queue item is made of, shared by every layer above: its request parameters,
its samples and conversation turns, the answer and its tokens, quality flags, the error
classes of its failures, and the length its answer is expected to have."""
