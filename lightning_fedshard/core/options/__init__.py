"""The federation's options as users write them, and the checks that refuse bad values before any work."""
