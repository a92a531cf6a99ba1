"""Model definitions (target, drafter), checkpoint loading and tokenizers."""
