"""Tools: manifest parsing, JSON Schema handling, stub generation and endpoint clients."""
