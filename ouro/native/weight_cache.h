// A native op's copies of weights in its own layout (oneDNN's blocked one, `onednn.cpp`; panels of
// columns, `panels.cpp`): one copy a weight, keyed by its data pointer and held against its storage
// weakly (a freed weight's copy is dropped on the next insert), made again when the weight's version
// moves (an in-place update outside inference mode) or its shape or dtype differ. A strided view is
// not cached: its contiguous copy is a temporary, so its entry would expire at once.
#pragma once
#include <ATen/core/Tensor.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace ouro {

class WeightCache {
  public:
    // `make(w)`'s copy of the contiguous 2-D weight w, made on first use and again after a change
    template <typename Make>
    at::Tensor get(const at::Tensor& w, Make make) {
        if (!w.is_contiguous()) return make(w.contiguous().detach());
        std::lock_guard<std::mutex> lock(mu_);
        auto it = cache_.find(w.data_ptr());
        if (it != cache_.end() && fresh(it->second, w)) return it->second.copy;
        for (auto e = cache_.begin(); e != cache_.end();)      // copies of freed weights go
            e = e->second.storage.expired() ? cache_.erase(e) : std::next(e);
        at::Tensor copy = make(w.detach());
        cache_.erase(w.data_ptr());
        cache_.emplace(w.data_ptr(), Entry{c10::weak_intrusive_ptr<c10::StorageImpl>(w.storage().getWeakStorageImpl()),
                                           version_of(w), w.sizes().vec(), w.scalar_type(), copy});
        return copy;
    }

    int64_t size() {
        std::lock_guard<std::mutex> lock(mu_);
        return static_cast<int64_t>(cache_.size());
    }

  private:
    struct Entry {
        c10::weak_intrusive_ptr<c10::StorageImpl> storage;
        int64_t version;
        std::vector<int64_t> shape;
        at::ScalarType dtype;
        at::Tensor copy;
    };

    static int64_t version_of(const at::Tensor& w) { return w.is_inference() ? 0 : static_cast<int64_t>(w._version()); }

    static bool fresh(const Entry& e, const at::Tensor& w) {
        return !e.storage.expired() && e.storage._unsafe_get_target() == w.storage().unsafeGetStorageImpl() &&
               e.version == version_of(w) && e.dtype == w.scalar_type() && c10::IntArrayRef(e.shape) == w.sizes();
    }

    std::mutex mu_;
    std::unordered_map<const void*, Entry> cache_;     // weight data pointer -> its copy
};

}  // namespace ouro
