"""Request bodies: declared once as pydantic models (validation and the OpenAPI schemas), their
errors as 400s naming the field, and a body read into the internal request."""
