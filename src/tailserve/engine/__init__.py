"""Request state, scheduler, model runner, sampler and the engine step loop."""
