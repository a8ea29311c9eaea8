# llm-serving image: the README's set-up, nothing else (deploy/ runs it on Kubernetes).
#   docker build -t llm-serving:latest .
FROM python:3.11-slim
# g++: the agents build their native CPU kernels at first start (agent/kernels)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN bash tools/setup.sh
EXPOSE 8835
CMD [".venv/bin/llm-serving", "--config", "configs/smollm2.yaml"]
