# The advisor image: `advisor serve` by default; docker-compose.yml runs the same image as the Ray
# head and worker nodes, so the driver and every trial see one Ray, one torch and one advisor.
#   docker build -t advisor .                                                              # CPU torch
#   docker build -t advisor --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .  # CUDA torch
# A CUDA wheel brings its own CUDA libraries; the host needs only the NVIDIA driver and the NVIDIA
# Container Toolkit (`docker run --gpus all`).
FROM python:3.11-slim

# The wheel index torch comes from: CPU by default (a few hundred MB, where PyPI's default build
# for Linux is the multi-GB CUDA one); any index with a 2.13.0 build works.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C and C++ compiler: torch.compile's CPU backend builds its kernels with g++ (Python's headers
# come with this image), and the estimator compiles its heap logger and replayer with cc. Without
# them, compiled trials fail (recorded as failures) and estimates say the heap was not replayed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned, as the Makefile does; the package accepts any 2.13.x, so `pip install .`
# keeps this build rather than replacing it. Its own layer: rebuilding for a code change skips it.
RUN pip install "torch==2.13.0" --index-url "${TORCH_INDEX}"

# The package (with ray[tune], the API server and the PostgreSQL driver). The sources stay out of
# the runtime working directory: Ray puts the driver's cwd on its workers' PYTHONPATH.
WORKDIR /opt/advisor
COPY . .
RUN pip install . && rm -rf build ./*.egg-info

# Non-root; /data (the store when no database URL is given, caches, Ray's and trials' scratch)
# belongs to that user before it becomes a volume (changes after VOLUME would be discarded).
RUN useradd --create-home --uid 10001 --user-group advisor \
    && mkdir -p /data && chown advisor:advisor /data
ENV ADVISOR_DATA_DIR=/data
VOLUME /data
USER advisor
WORKDIR /home/advisor

EXPOSE 8000
# The app binds 127.0.0.1 unless told otherwise; in a container it must listen on all interfaces
# to be reachable through a published port, so set ADVISOR_API_TOKEN (POST /v1/tune and DELETE
# answer 403 without it) and publish the port on loopback or behind a proxy.
CMD ["advisor", "serve", "--host", "0.0.0.0"]
