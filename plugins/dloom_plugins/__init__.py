"""Built-in dloom strategy plugins."""
