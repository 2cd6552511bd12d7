// Native post-accumulate-grad hooks for tribucket's reducer: the per-gradient common case
// (mark ready, count down in its bucket) without entering Python; Python is called once per
// completed bucket, and for every gradient the native path does not handle.
#include <torch/extension.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/Exceptions.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

namespace py = pybind11;
using torch::autograd::variable_list;

namespace {

struct State {
  std::vector<int32_t> bucket_of;    // per parameter: its bucket
  std::vector<uint8_t> native;       // per bucket: counted here during an enabled pass
  std::vector<int32_t> pending;      // per bucket: gradients not yet counted
  std::vector<int64_t> first_ns;     // per bucket, when stamping: its first gradient's time
  bool stamp = false;                // record first_ns this pass (a trace is being taken)
  uint8_t* ready = nullptr;          // per parameter: the pass's ready flags (Python's bytearray)
  at::Tensor ready_owner;            // keeps that buffer alive
  bool enabled = false;              // a pass whose native buckets are counted here
  std::atomic<bool> detached{false}; // the reducer is gone: the hook does nothing
  py::object on_complete;            // on_complete(bucket): a native bucket's count reached 0
  py::object fallback;               // fallback(param): every other gradient
};

// time.perf_counter_ns()'s clock (CLOCK_MONOTONIC on Linux)
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

void stamp_first(State& s, int32_t b) {
  if (s.stamp && s.first_ns[b] == 0) s.first_ns[b] = now_ns();
}

void call_python(const py::object& fn, int64_t arg) {
  py::gil_scoped_acquire gil;
  try {
    fn(arg);
  } catch (py::error_already_set& e) {
    e.restore();
    throw python_error();  // rethrown to backward()'s caller as the original exception
  }
}

struct ReadyHook : torch::autograd::FunctionPostHook {
  std::shared_ptr<State> st;
  int64_t index;
  ReadyHook(std::shared_ptr<State> s, int64_t i) : st(std::move(s)), index(i) {}

  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    State& s = *st;
    if (s.detached.load(std::memory_order_relaxed)) {
      return outputs;
    }
    if (s.enabled && !s.ready[index]) {
      const int32_t b = s.bucket_of[index];
      if (s.native[b]) {
        s.ready[index] = 1;
        stamp_first(s, b);
        if (--s.pending[b] == 0) {
          call_python(s.on_complete, b);
        }
        return outputs;
      }
    }
    call_python(s.fallback, index);
    return outputs;
  }
};

class Hooks {
 public:
  Hooks(std::vector<at::Tensor> params, py::object on_complete, py::object fallback)
      : st_(std::make_shared<State>()) {
    st_->bucket_of.assign(params.size(), 0);
    st_->on_complete = std::move(on_complete);
    st_->fallback = std::move(fallback);
    for (size_t i = 0; i < params.size(); ++i) {
      // the grad accumulator is held here: the tensor keeps only a weak reference, and a
      // new one (without this hook) would be made for the next backward
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      TORCH_CHECK(acc, "parameter ", i, " has no gradient accumulator (requires_grad=False?)");
      keys_.push_back(acc->add_post_hook(std::make_unique<ReadyHook>(st_, (int64_t)i)));
      accs_.push_back(std::move(acc));
    }
  }
  // Garbage collection of the reducer (possibly from inside a hook, during backward): the
  // hooks stay on the accumulators, inert, and go with them; erasing them here could pull
  // them from under the engine while it runs them.
  ~Hooks() { detach(); }

  // close(): take the hooks off the accumulators
  void remove() {
    for (size_t i = 0; i < accs_.size(); ++i) accs_[i]->del_post_hook(keys_[i]);
    detach();
  }

  // (with the GIL held: from Python, or by the Python object's deallocation)
  void detach() {
    st_->detached = true;
    st_->enabled = false;
    st_->ready = nullptr;
    st_->ready_owner = at::Tensor();  // its storage holds the Python bytearray
    accs_.clear();
    keys_.clear();
    // the callbacks are released here, under the GIL, not when the last inert hook dies
    // (possibly on an autograd thread without it)
    py::object on_complete = std::move(st_->on_complete);
    py::object fallback = std::move(st_->fallback);
  }

  // the bucket of each parameter (a new layout); no pass may be under way
  void layout(std::vector<int32_t> bucket_of, int64_t n_buckets) {
    TORCH_CHECK(!st_->enabled, "layout changed during a pass");
    TORCH_CHECK(bucket_of.size() == st_->bucket_of.size(), "one bucket per parameter");
    for (int32_t b : bucket_of) TORCH_CHECK(b >= 0 && b < n_buckets, "bucket out of range");
    st_->bucket_of = std::move(bucket_of);
    st_->native.assign(n_buckets, 0);
    st_->pending.assign(n_buckets, 0);
    st_->first_ns.assign(n_buckets, 0);
  }

  // a pass begins: ``ready`` (uint8, one per parameter) is the pass's flags, ``pending`` the
  // count of each bucket, ``native`` which buckets are counted here, ``stamp`` whether to
  // record each native bucket's first gradient time
  void begin(at::Tensor ready, std::vector<int32_t> pending, std::vector<uint8_t> native,
             bool stamp) {
    TORCH_CHECK(ready.is_contiguous() && ready.scalar_type() == at::kByte &&
                ready.numel() == (int64_t)st_->bucket_of.size(), "ready: one byte per parameter");
    TORCH_CHECK(pending.size() == st_->pending.size() && native.size() == st_->native.size());
    st_->ready_owner = ready;
    st_->ready = ready.data_ptr<uint8_t>();
    st_->pending = std::move(pending);
    st_->native = std::move(native);
    st_->stamp = stamp;
    if (stamp) std::fill(st_->first_ns.begin(), st_->first_ns.end(), 0);
    st_->enabled = true;
  }

  // mark parameter ``i`` of a native bucket from Python; whether its bucket is complete
  bool mark(int64_t i) {
    State& s = *st_;
    s.ready[i] = 1;
    stamp_first(s, s.bucket_of[i]);
    return --s.pending[s.bucket_of[i]] == 0;
  }

  // when bucket ``b``'s first gradient was counted here this pass (perf_counter_ns; 0: not
  // stamped)
  int64_t first_ns(int64_t b) const { return st_->first_ns.at(b); }

  // the indices of ``params`` (the reducer's, in order) whose gradient accumulator is no
  // longer the one hooked here: torch drops it when ``param.data`` is set to a tensor of
  // another dtype or device (model.half(), .to(...)), and the next one has no hook
  std::vector<int64_t> stale(const std::vector<at::Tensor>& params) const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < params.size() && i < accs_.size(); ++i) {
      auto acc = torch::autograd::impl::try_get_grad_accumulator(params[i]);
      if (acc.get() != accs_[i].get()) out.push_back((int64_t)i);
    }
    return out;
  }

  // the pass ends: the counts left
  std::vector<int32_t> end() {
    st_->enabled = false;
    st_->ready = nullptr;
    st_->ready_owner = at::Tensor();
    return st_->pending;
  }

 private:
  std::shared_ptr<State> st_;
  // (a shared_ptr in older torch releases, an intrusive_ptr in newer ones: whichever this
  // torch returns)
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))>
      accs_;
  std::vector<uintptr_t> keys_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // post hooks on a leaf tensor's gradient accumulator (0 without one): tests check that
  // close() leaves none behind
  m.def("post_hook_count", [](const at::Tensor& t) -> int64_t {
    auto acc = torch::autograd::impl::try_get_grad_accumulator(t);
    return acc ? (int64_t)acc->post_hooks().size() : 0;
  });
  py::class_<Hooks>(m, "Hooks")
      .def(py::init<std::vector<at::Tensor>, py::object, py::object>())
      .def("layout", &Hooks::layout)
      .def("remove", &Hooks::remove)
      .def("begin", &Hooks::begin)
      .def("mark", &Hooks::mark)
      .def("first_ns", &Hooks::first_ns)
      .def("stale", &Hooks::stale)
      .def("end", &Hooks::end);
}
