// Python side of export_sequence / import_sequence (bindings/state_io.hpp), shared by the CPU glue
// (engine_bindings.cpp) and the CUDA glue (cuda/cuda_bindings.cpp): a dict of name -> f32 array each
// way, every argument checked (ValueError naming the tensor) before the engine sees it.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <vector>

#include "pyglue.hpp"
#include "state_io.hpp"

namespace glm::pyglue {

// -> (length, {name: f32 array}) in the layout's order.
template <class Engine>
py::tuple export_state(Engine& E, int64_t id) {
    int64_t length = 0;
    std::vector<StateTensor> ts;
    try {
        ts = E.export_sequence(id, length);
    } catch (const std::invalid_argument& e) {
        bad(e.what());
    }
    py::dict d;
    for (const StateTensor& t : ts) {
        py::array_t<float> a(std::vector<py::ssize_t>(t.shape.begin(), t.shape.end()));
        if (!t.data.empty()) std::memcpy(a.mutable_data(), t.data.data(), t.data.size() * sizeof(float));
        d[py::str(t.name)] = a;
    }
    return py::make_tuple(length, d);
}

template <class Engine>
int64_t import_state(Engine& E, const py::object& arrays_o, const py::object& length_o) {
    if (!py::isinstance<py::dict>(arrays_o)) bad("import: arrays must be a dict of name -> float32 array");
    if (!py::isinstance<py::int_>(length_o) || py::isinstance<py::bool_>(length_o)) bad("import: length must be an int");
    const int64_t length = length_o.cast<int64_t>();
    std::vector<StateTensor> ts;
    for (const auto& kv : py::reinterpret_borrow<py::dict>(arrays_o)) {
        if (!py::isinstance<py::str>(kv.first)) bad("import: state tensor names must be strings");
        const std::string name = kv.first.cast<std::string>();
        if (!py::isinstance<py::array>(kv.second)) bad("import: state tensor '" + name + "' is not a numpy array");
        const py::array a = py::reinterpret_borrow<py::array>(kv.second);
        if (a.dtype().kind() != 'f' || a.itemsize() != 4)
            bad("import: state tensor '" + name + "' has dtype " + py::str(a.dtype()).cast<std::string>() +
                ", expected float32");
        const py::array_t<float, py::array::c_style | py::array::forcecast> c(a);  // (a copy only if strided)
        StateTensor t{name, shape_of(a), {}};
        t.data.assign(c.data(), c.data() + c.size());
        ts.push_back(std::move(t));
    }
    try {
        return E.import_sequence(ts, length);
    } catch (const std::invalid_argument& e) {
        bad(e.what());
    }
}

}  // namespace glm::pyglue
