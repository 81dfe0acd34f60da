# kvwire's core pipeline (schemas, producer, consumer, CLI). The LMCache/vLLM extras are not
# installed: they belong in the engine's own image, next to the connector they wrap.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY producer producer
COPY consumer consumer
COPY kvwire kvwire

RUN pip install --no-cache-dir . && useradd --system kvwire
USER kvwire
EXPOSE 8080
ENTRYPOINT ["kvwire"]
CMD ["index", "--http", "0.0.0.0:8080"]
