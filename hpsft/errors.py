"""The error type for bad input a user can fix (data, paths, settings that do not fit
together). Entry points report it as one line without a traceback; any other exception
is a bug and keeps its traceback."""


class UserInputError(ValueError):
    pass
