"""HTTP routes: one file per OpenAI endpoint family."""
