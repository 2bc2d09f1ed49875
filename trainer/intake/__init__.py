"""From the correction stream to what the trainer keeps: entries, training examples, buffer, held-out split."""
