"""Integrations of flashtree's trees into other engines. Each subpackage imports its engine; flashtree itself never does."""
