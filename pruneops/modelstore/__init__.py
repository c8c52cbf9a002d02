"""The model registry: published candidates, the production pointer, promotion and rollback."""
