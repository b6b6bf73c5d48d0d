"""The base of every wire model: a field it does not know is refused by name, never silently dropped, so a
misspelt parameter on an input line is an error rather than a default."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=False)
