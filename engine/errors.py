"""Errors the engine raises for bad input. Each message names the thing at fault."""


class EngineError(Exception):
    """Base class: anything the engine refuses, with a one-line message fit for a user."""


class ModelFileError(EngineError):
    """A model file that cannot be used: unreadable, malformed, or not what its metadata claims."""


class UnsupportedModelError(ModelFileError):
    """A well-formed model file using an architecture, tensor type or vocabulary we do not run."""


class SettingsError(EngineError):
    """Settings that cannot be honoured (context size, threads, sampling values)."""


class TemplateError(EngineError):
    """A chat template that cannot be rendered."""


class GrammarError(EngineError):
    """A constraint that cannot be compiled: a bad JSON schema, grammar or regex."""
