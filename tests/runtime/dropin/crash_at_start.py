"""A script with a plain bug: it raises the same KeyError at start, on every rank, in every attempt."""

config = {"lr": 1e-3}

if __name__ == "__main__":
    print("batch size", config["batch_size"])
